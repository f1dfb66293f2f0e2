"""llama3_json / llama4_json: `{"name": ..., "parameters" | "arguments": ...}`, optionally after `<|python_tag|>`,
several separated by `;`.

As vLLM's Llama3JsonToolParser streams it: an output is a call only when it starts with
`<|python_tag|>` or `{`; then content is null and each complete JSON object with a name is
a call (arguments re-serialised). An output that starts like JSON but holds no call (a model
answering in JSON) is returned as content, unless it began as a call and was cut short.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from token_proxy.tools.calls import FunctionCall, IdFactory, vllm_call_id
from token_proxy.tools.formats.scan import Scan, dump_arguments, first_json

PYTHON_TAG = "<|python_tag|>"
_CALL_START = re.compile(r'\s*\{\s*"name"')


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
