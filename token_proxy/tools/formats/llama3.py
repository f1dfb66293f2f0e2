"""llama3_json / llama4_json: `{"name": ..., "parameters" | "arguments": ...}`, optionally after `<|python_tag|>`,
several separated by `;`.

As vLLM's Llama3JsonToolParser streams it: an output is a call only when it starts with
`<|python_tag|>` or `{`; then content is null and each complete JSON object with a name is
a call (arguments re-serialised). An output that starts like JSON but holds no call (a model
answering in JSON) is returned as content, unless it began as a call and was cut short.

Streamed (`progress`): vLLM sends the header as soon as a partial parse shows a complete
`"name"` (so a JSON answer with a "name" key gets a header, then comes back as content in
the non-streamed reply). Here an open object's header waits until `{"name": "…", ` is
followed by `"parameters":` or `"arguments":` and the output can no longer be content: the
object is the output's first (it starts with `{"name"`) or a call came before it. Such an
object, once complete, is a call, so what was sent is its head; it is taken back never, and
only a cut or malformed object leaves a half call, as in vLLM. The arguments are the fixed
head of json.dumps (as vLLM's diff of json.dumps of its partial parse). One divergence, as
vLLM's own: an object with both "parameters" and "arguments" (vLLM rejects it; the
non-streamed call here takes "arguments") streams "parameters" only if it came first.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from token_proxy.tools.calls import FunctionCall, IdFactory, vllm_call_id
from token_proxy.tools.formats.json_prefix import JsonHead
from token_proxy.tools.formats.scan import CallProgress, Scan, dump_arguments, first_json

PYTHON_TAG = "<|python_tag|>"
_CALL_START = re.compile(r'\s*\{\s*"name"')
# An open object's head, as Llama's templates write it: name first, then its arguments' key.
_OPEN_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:')


def _objects(region: str) -> tuple[list[object], bool]:
    """Complete JSON values in `region`, separated by whitespace or `;`; and whether all of it parsed."""
    values, pos = [], 0
    while pos < len(region):
        rest = region[pos:].lstrip().lstrip(";")
        if not rest.strip():
            return values, True
        parsed = first_json(rest)
        if parsed is None:
            return values, False
        values.append(parsed[0])
        pos = len(region) - len(rest) + parsed[1]
    return values, True


def _as_call(obj: object) -> FunctionCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if "arguments" not in obj and "parameters" not in obj:
        return None
    return FunctionCall(obj["name"], dump_arguments(obj["arguments"] if "arguments" in obj else obj["parameters"]))


@dataclass(frozen=True)
class Llama3JsonFormat:
    name: str = "llama3_json"
    new_id: IdFactory = vllm_call_id
    triggers: str = '{<'  # first characters of the markers (see ToolFormat)
    prefix_content: bool = False  # see ToolFormat

    def scan(self, text: str, final: bool, tools: list | None) -> Scan:
        if not text.startswith("{") and not text.startswith(PYTHON_TAG):
            if not final and PYTHON_TAG.startswith(text):
                return Scan()  # maybe the tag, still arriving
            return Scan(content=text)
        region = text.removeprefix(PYTHON_TAG)
        values, _ = _objects(region)
        calls = [call for call in map(_as_call, values) if call is not None]
        if final and not calls and not _CALL_START.match(region):
            return Scan(content=text)
        return Scan(calls=calls)

    def progress(self, text: str, final: bool, tools: list | None, memo: dict | None = None) -> list[CallProgress]:
        """The complete calls (as `scan`), and an open object's name and fixed arguments head once it
        is sure to be a call if it completes (see the module's docstring)."""
        memo = {} if memo is None else memo
        if not text.startswith("{") and not text.startswith(PYTHON_TAG):
            return []
        region = text.removeprefix(PYTHON_TAG)
        calls, pos = [], 0
        while pos < len(region):  # _objects' walk
            rest = region[pos:].lstrip().lstrip(";")
            if not rest.strip():
                break
            parsed = first_json(rest)
            at = len(region) - len(rest)
            if parsed is not None:
                call = _as_call(parsed[0])
                if call is not None:
                    calls.append(CallProgress(call.name, call.arguments))
                pos = at + parsed[1]
                continue
            head = _OPEN_CALL.match(rest)
            if head is not None and (calls or _CALL_START.match(region)):
                dump = memo.setdefault(at, JsonHead()).advance(rest[head.end():], final)[0]
                calls.append(CallProgress(json.loads(head[1]), dump))
            break
        return calls
