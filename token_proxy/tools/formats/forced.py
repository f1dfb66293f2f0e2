"""Outputs constrained by tool_choice "required" or a named function (see tools.constraint).

vLLM parses these as JSON, not with the model's tool parser: "required" yields a JSON array
of `{"name", "parameters"}` (arguments = json.dumps(parameters)), a named function yields its
arguments object itself. Content is "" (vLLM: `content or ""` when a call is forced).
A call counts once its JSON is complete, so a cut-off array keeps only its complete items.
"""

from __future__ import annotations

from dataclasses import dataclass

from token_proxy.tools.calls import FunctionCall, IdFactory, vllm_call_id
from token_proxy.tools.formats.scan import Scan, dump_arguments, first_json


def _array_items(text: str) -> list[object]:
    body = text.lstrip()
    if not body.startswith("["):
        return []
    items, pos = [], 1
    while True:
        rest = body[pos:].lstrip()
        if not rest or rest.startswith("]"):
            return items
        parsed = first_json(rest)
        if parsed is None:
            return items
        items.append(parsed[0])
        rest = rest[parsed[1]:].lstrip()
        pos = len(body) - len(rest)
        if rest.startswith(","):
            pos += 1


@dataclass(frozen=True)
class RequiredFormat:
    name: str = "required"
    new_id: IdFactory = vllm_call_id
    triggers: str = ""  # empty: no shortcut, always rescanned
    prefix_content: bool = False  # see ToolFormat

    def scan(self, text: str, final: bool, tools: list | None) -> Scan:
        calls = [
            FunctionCall(item["name"], dump_arguments(item.get("parameters", {})))
            for item in _array_items(text)
            if isinstance(item, dict) and isinstance(item.get("name"), str)
        ]
        return Scan(calls=calls)


@dataclass(frozen=True)
class NamedFormat:
    function: str
    name: str = "named"
    new_id: IdFactory = vllm_call_id
    triggers: str = ""  # empty: no shortcut, always rescanned
    prefix_content: bool = False  # see ToolFormat

    def scan(self, text: str, final: bool, tools: list | None) -> Scan:
        parsed = first_json(text)
        if parsed is None:
            return Scan()
        lead = len(text) - len(text.lstrip())
        return Scan(calls=[FunctionCall(self.function, text[lead : parsed[1]])])
