"""Outputs constrained by tool_choice "required" or a named function (see tools.constraint).

vLLM parses these as JSON, not with the model's tool parser: "required" yields a JSON array
of `{"name", "parameters"}` (arguments = json.dumps(parameters)), a named function yields its
arguments object itself. Content is "" (vLLM: `content or ""` when a call is forced).
A call counts once its JSON is complete, so a cut-off array keeps only its complete items.

Streamed (`progress`) as vLLM 0.33's serving layer streams them: the first delta of a call
carries its id, name and the arguments so far (`header_carries_arguments`), later ones the
arguments' new text. A named function's call starts with the output (its name is the
request's) and streams the arguments as written; a "required" item starts once its `"name"`
is complete and its `"parameters"` value has begun (vLLM's `ready`), and streams the fixed
head of json.dumps(parameters), the text its complete call carries (vLLM sends the raw text,
which the non-streamed reply's re-serialised arguments need not equal).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from token_proxy.tools.calls import FunctionCall, IdFactory, vllm_call_id
from token_proxy.tools.formats.json_prefix import JsonHead, raw_head
from token_proxy.tools.formats.scan import CallProgress, Scan, dump_arguments, first_json

# An open "required" item's head: name first, then parameters (the constraint's schema order).
_ITEM_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:')


def _array_items(text: str) -> tuple[list[object], int | None]:
    """The array's complete items, and where the next (incomplete) item's text begins (None: none)."""
    body = text.lstrip()
    if not body.startswith("["):
        return [], None
    lead = len(text) - len(body)
    items, pos = [], 1
    while True:
        rest = body[pos:].lstrip()
        if not rest or rest.startswith("]"):
            return items, None
        parsed = first_json(rest)
        if parsed is None:
            return items, lead + len(body) - len(rest)
        items.append(parsed[0])
        rest = rest[parsed[1]:].lstrip()
        pos = len(body) - len(rest)
        if rest.startswith(","):
            pos += 1


def _required_call(item: object) -> FunctionCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    return FunctionCall(item["name"], dump_arguments(item.get("parameters", {})))


@dataclass(frozen=True, kw_only=True)  # keyword-only: NamedFormat(function) stays positional
class _Forced:
    """What both forced formats share (see ToolFormat)."""

    new_id: IdFactory = vllm_call_id
    triggers: str = ""  # empty: no shortcut, always rescanned
    prefix_content: bool = False
    header_carries_arguments: bool = True  # vLLM's serving layer: see output_parser._stream_fragments


@dataclass(frozen=True)
class RequiredFormat(_Forced):
    name: str = "required"

    def scan(self, text: str, final: bool, tools: list | None) -> Scan:
        calls = [_required_call(item) for item in _array_items(text)[0]]
        return Scan(calls=[call for call in calls if call is not None])

    def progress(self, text: str, final: bool, tools: list | None, memo: dict | None = None) -> list[CallProgress]:
        """The complete items' calls, and the open item's name and fixed head of json.dumps(parameters)."""
        memo = {} if memo is None else memo
        items, open_at = _array_items(text)
        calls = [CallProgress(call.name, call.arguments) for call in map(_required_call, items) if call is not None]
        head = _ITEM_HEAD.match(text, open_at) if open_at is not None else None
        if head is not None and text[head.end():].strip():  # vLLM: once the parameters value has begun
            dump = memo.setdefault(open_at, JsonHead()).advance(text[head.end():], final)[0]
            calls.append(CallProgress(json.loads(head[1]), dump))
        return calls


@dataclass(frozen=True)
class NamedFormat(_Forced):
    function: str
    name: str = "named"

    def scan(self, text: str, final: bool, tools: list | None) -> Scan:
        parsed = first_json(text)
        if parsed is None:
            return Scan()
        lead = len(text) - len(text.lstrip())
        return Scan(calls=[FunctionCall(self.function, text[lead : parsed[1]])])

    def progress(self, text: str, final: bool, tools: list | None, memo: dict | None = None) -> list[CallProgress]:
        """The one call, from the output's first text: its arguments as written, as far as they are valid JSON."""
        if not text:
            return []
        done = self.scan(text, final, tools).calls  # as `scan` has it (JsonHead stops at a repeated key)
        if done:
            return [CallProgress(self.function, done[0].arguments)]
        head = (memo if memo is not None else {}).setdefault("named", JsonHead())
        return [CallProgress(self.function, raw_head(head, text, final))]
