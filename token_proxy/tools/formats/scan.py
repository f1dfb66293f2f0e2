"""The contract every tool-call format implements, and the small text helpers they share.

A format is a pure function `scan(text, final, tools) -> Scan`. Streaming replays it on
the growing text, so it must be prefix-stable: for a longer text, `content` extends the
earlier `content` and `calls` extends the earlier `calls`. With `final=False` it holds
back whatever could still turn out to be part of a call (an open call, a partial marker).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from token_proxy.tools.calls import FunctionCall, IdFactory

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class Scan:
    content: str = ""
    calls: list[FunctionCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CallProgress:
    """A call begun in a streamed text: its name and the fixed head of its arguments text
    (all of it once the call is complete; see json_prefix). Formats that can say this
    (`progress`) stream argument fragments; the others stream each call whole."""

    name: str
    arguments: str


class ToolFormat(Protocol):
    name: str
    new_id: IdFactory  # the id a new call gets
    # First characters of the format's markers. While a scan is all content (nothing held
    # back, no call), a delta without any of them only extends the content: no rescan needed.
    triggers: str
    # Content is exactly the text before the first call marker: a stream may then rescan only
    # the text after what it already emitted (hermes, qwen3_coder, mistral).
    prefix_content: bool

    def scan(self, text: str, final: bool, tools: list | None) -> Scan: ...

    # Optional (every format here has it): every call region begun in `text` whose name is known, in
    # order, each `arguments` a prefix of the text the finished call carries. `memo` is the
    # stream's dict, kept between calls, so the format can go on where it stopped. A format may
    # also set `header_carries_arguments` (the forced ones): a call's first delta then carries
    # its arguments so far beside its name, as vLLM's serving layer sends a forced call.
    # def progress(self, text: str, final: bool, tools: list | None, memo: dict | None) -> list[CallProgress]: ...

    # Optional: a non-streamed reply's scan where vLLM's non-streaming parser reads a text otherwise than its
    # stream (hermes: vLLM's regex regions, and any bad call gives no calls and the whole text as content).
    # def whole(self, text: str, tools: list | None) -> Scan: ...


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def content_before(text: str, start: int, final: bool, markers: tuple[str, ...]) -> str:
    """The text before a call region starting at `start` (-1: none yet), minus a partial marker."""
    if start >= 0:
        return text[:start]
    if final:
        return text
    return text[: len(text) - held_back(text, markers)]


def split_at(text: str, marker: str, final: bool) -> tuple[str, int]:
    """The content before the first `marker` (see content_before) and where the marker starts (-1: none)."""
    start = text.find(marker)
    return content_before(text, start, final, (marker,)), start


def first_json(text: str) -> tuple[object, int] | None:
    """The first JSON value at the start of `text` (after whitespace) and where it ends; None if incomplete/invalid."""
    stripped = len(text) - len(text.lstrip())
    try:
        value, end = _DECODER.raw_decode(text, stripped)
    except json.JSONDecodeError:
        return None
    return value, end


def dump_arguments(arguments: object) -> str:
    """vLLM re-serialises parsed arguments with json.dumps(..., ensure_ascii=False)."""
    return json.dumps(arguments, ensure_ascii=False)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return False
    return True
