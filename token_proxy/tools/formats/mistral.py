"""mistral: v11+ `[TOOL_CALLS]name[ARGS]{...}` (or `name{...}`), repeatable; pre-v11 `[TOOL_CALLS] [{"name", "arguments"}, ...]`.

As vLLM 0.33's Mistral parser: content is the text before the first `[TOOL_CALLS]`; v11
arguments are the raw first JSON value after the name (trailing text dropped), pre-v11
arguments are re-serialised; call ids are 9 alphanumerics. A call counts once its JSON is complete.
"""

from __future__ import annotations

from dataclasses import dataclass

from token_proxy.tools.calls import FunctionCall, IdFactory, mistral_call_id
from token_proxy.tools.formats.scan import Scan, content_before, dump_arguments, first_json

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


def _pre_v11_arguments(arguments: object) -> str:
    """vLLM's _pre_v11_function_calls: missing → "{}", a string is kept as it is, else json.dumps."""
    if arguments is None:
        return "{}"
    return arguments if isinstance(arguments, str) else dump_arguments(arguments)


def _segment_calls(segment: str) -> list[FunctionCall]:
    stripped = segment.lstrip()
    if stripped.startswith(("[", "{")):  # pre-v11: a JSON list (or one object) of {"name", "arguments"}
        parsed = first_json(stripped)
        if parsed is None:
            return []
        items = parsed[0] if isinstance(parsed[0], list) else [parsed[0]]
        return [
            FunctionCall(item["name"], _pre_v11_arguments(item.get("arguments")))
            for item in items
            if isinstance(item, dict) and isinstance(item.get("name"), str)
        ]
    cut = [i for i in (segment.find(ARGS), segment.find("{")) if i >= 0]
    if not cut:
        return []
    name = segment[: min(cut)].strip()
    args_text = segment[min(cut) + (len(ARGS) if segment.startswith(ARGS, min(cut)) else 0):]
    parsed = first_json(args_text)
    if not name or parsed is None:
        return []
    lead = len(args_text) - len(args_text.lstrip())
    return [FunctionCall(name, args_text[lead : parsed[1]])]


@dataclass(frozen=True)
class MistralFormat:
    name: str = "mistral"
    new_id: IdFactory = mistral_call_id
    triggers: str = '['  # first characters of the markers (see ToolFormat)
    prefix_content: bool = True  # see ToolFormat

    def scan(self, text: str, final: bool, tools: list | None) -> Scan:
        start = text.find(TOOL_CALLS)
        content = content_before(text, start, final, (TOOL_CALLS,))
        if start < 0:
            return Scan(content)
        segments = text[start:].split(TOOL_CALLS)[1:]
        calls = [call for segment in segments for call in _segment_calls(segment)]
        return Scan(content, calls)
