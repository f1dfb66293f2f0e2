"""hermes (Qwen2.5, Qwen3, Hermes 2 Pro; vLLM alias qwen3_json): `<tool_call>{"name", "arguments"}</tool_call>`.

As vLLM's Hermes2ProToolParser: content is the text before the first `<tool_call>` (text
between and after calls is dropped), arguments are re-serialised with json.dumps.

A non-streamed reply's closed calls are vLLM's `extract_tool_calls` (`whole`): a call ends at the first
`</tool_call>`, even one inside a JSON string, and if one is not a JSON object with `name` and `arguments`,
there are no calls and the whole text is content. A last call without `</tool_call>` (cut by max_tokens)
counts once the output is final and its JSON is complete, else it is dropped and not content (vLLM: the
whole text as content, even for complete JSON, as its json.loads reads a cut end tag too).

A stream (`scan` / `progress`) cannot take back what it sent: a call whose JSON is malformed or lacks
name/arguments is dropped, and a `</tool_call>` inside a JSON string of the call does not end it (vLLM's
stream sends the arguments cut at that tag).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from token_proxy.tools.calls import FunctionCall, IdFactory, vllm_call_id
from token_proxy.tools.formats.json_prefix import JsonHead
from token_proxy.tools.formats.scan import (
    CallProgress,
    Scan,
    content_before,
    dump_arguments,
    first_json,
    held_back,
)

START, END = "<tool_call>", "</tool_call>"
# An open call's head: name first, then arguments, as Hermes / Qwen templates write them. As vLLM's
# streaming parser: the header once `"name": "..."` is complete, then what follows `"arguments":`
# (arguments written before the name are sent whole, once the call is complete).
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:')


def call_from_json(body: str) -> FunctionCall | None:
    """A `{"name": ..., "arguments": ...}` object (nothing after it) as a call."""
    parsed = first_json(body)
    if parsed is None or body[parsed[1]:].strip():
        return None
    obj = parsed[0]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    return FunctionCall(obj["name"], dump_arguments(obj["arguments"]))


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_OBJECT_START = re.compile(r"\s*\{")


def json_region_end(text: str, body_start: int, end_tag: str) -> int:
    """Where a region's end tag starts (-1: not yet). When the body is a JSON object, the first end tag
    outside its strings: an argument may hold the literal tag (`{"s": "a </tool_call> b"}`), which must
    neither end the call early nor split it in two. Otherwise the first end tag."""
    if not _OBJECT_START.match(text, body_start):
        return text.find(end_tag, body_start)
    pos = body_start
    while True:
        end, quote = text.find(end_tag, pos), text.find('"', pos)
        if quote < 0 or 0 <= end < quote:
            return end
        string = _STRING.match(text, quote)
        if string is None:  # a string still arriving: the tag cannot come before it closes
            return -1
        pos = string.end()


def tagged_regions(text: str, start_tag: str, end_tag: str, final: bool, json_bodies: bool = False) -> list[str]:
    """The bodies of `start…end` regions; an unterminated last one only when final. `json_bodies`: an
    end tag inside a JSON string of the body does not end it (json_region_end)."""
    bodies, pos = [], 0
    while (start := text.find(start_tag, pos)) >= 0:
        body_start = start + len(start_tag)
        end = json_region_end(text, body_start, end_tag) if json_bodies else text.find(end_tag, body_start)
        if end < 0:
            if final:  # a partial end tag at the very end does not spoil the body
                body = text[body_start:]
                bodies.append(body[: len(body) - held_back(body, (end_tag,))])
            break
        bodies.append(text[body_start:end])
        pos = end + len(end_tag)
    return bodies


@dataclass(frozen=True)
class HermesFormat:
    name: str = "hermes"
    new_id: IdFactory = vllm_call_id
    triggers: str = '<'  # first characters of the markers (see ToolFormat)
    prefix_content: bool = True  # see ToolFormat

    def scan(self, text: str, final: bool, tools: list | None) -> Scan:
        content = content_before(text, text.find(START), final, (START,))
        calls = [call_from_json(body) for body in tagged_regions(text, START, END, final, json_bodies=True)]
        return Scan(content, [call for call in calls if call is not None])

    def whole(self, text: str, tools: list | None) -> Scan:
        """vLLM's extract_tool_calls for the closed calls: each ends at the first `</tool_call>` (its regex's
        region, even inside a JSON string), and one that is not `{"name", "arguments"}` JSON spoils them all:
        no calls, the whole text as content. A last call left open (cut by max_tokens) is `scan`'s."""
        first = text.find(START)
        if first < 0:
            return Scan(content=text)
        calls, pos = [], first
        while (start := text.find(START, pos)) >= 0:
            end = text.find(END, start + len(START))
            if end < 0:
                calls += self.scan(text[start:], True, tools).calls
                break
            call = call_from_json(text[start + len(START):end])
            if call is None:
                return Scan(content=text)
            calls.append(call)
            pos = end + len(END)
        return Scan(text[:first], calls)

    def progress(self, text: str, final: bool, tools: list | None, memo: dict | None = None) -> list[CallProgress]:
        """Each `<tool_call>` region with a known name: closed ones parsed (as `scan`), the open one's
        arguments as far as they are fixed. A later call waits for an earlier name. `memo` (the
        stream's, kept between calls) holds a JsonHead per region, so each call costs about the delta."""
        memo = {} if memo is None else memo
        calls, pos = [], 0
        while (start := text.find(START, pos)) >= 0:
            body_start = start + len(START)
            end = json_region_end(text, body_start, END)
            body = text[body_start:] if end < 0 else text[body_start:end]
            if end < 0:
                body = body[: len(body) - held_back(body, (END,))]
            name = _NAME.match(body)
            arguments = _ARGUMENTS.match(body, name.end()) if name else None
            # A closed (or final) region is a call if it parses, as `scan` decides.
            call = call_from_json(body) if end >= 0 or final or (name and not arguments) else None
            if call is not None:
                calls.append(CallProgress(call.name, call.arguments))
            elif name is not None:
                head = memo.setdefault(body_start, JsonHead())
                calls.append(CallProgress(json.loads(name[1]),
                                          head.advance(body[arguments.end():], final)[0] if arguments else ""))
            elif end < 0:
                break  # its name is still arriving
            if end < 0:
                break
            pos = end + len(END)
        return calls
