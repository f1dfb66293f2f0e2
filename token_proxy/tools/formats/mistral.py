"""mistral: v11+ `[TOOL_CALLS]name[ARGS]{...}` (or `name{...}`), repeatable; pre-v11 `[TOOL_CALLS] [{"name", "arguments"}, ...]`.

As vLLM 0.33's Mistral parser: content is the text before the first `[TOOL_CALLS]`; v11
arguments are the raw first JSON value after the name (trailing text dropped), pre-v11
arguments are re-serialised; call ids are 9 alphanumerics. A call counts once its JSON is complete.

Streamed (`progress`) as vLLM's v11 parser streams it: the header once the name is ended by
`[ARGS]` or `{`, then the arguments as the model writes them, as far as they are valid JSON.
Pre-v11 arrays go out one whole call at a time, once the whole array parses: `scan` takes
the array's items only then (one malformed item drops them all), so an item streamed earlier
could turn out not to be a call although it was complete.
"""

from __future__ import annotations

from dataclasses import dataclass

from token_proxy.tools.calls import FunctionCall, IdFactory, mistral_call_id
from token_proxy.tools.formats.json_prefix import JsonHead, raw_head
from token_proxy.tools.formats.scan import CallProgress, Scan, dump_arguments, first_json, held_back, split_at

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


def _pre_v11_arguments(arguments: object) -> str:
    """vLLM's _pre_v11_function_calls: missing → "{}", a string is kept as it is, else json.dumps."""
    if arguments is None:
        return "{}"
    return arguments if isinstance(arguments, str) else dump_arguments(arguments)


def _is_pre_v11(segment: str) -> bool:
    return segment.lstrip().startswith(("[", "{"))


def _name_end(segment: str) -> tuple[str, str] | None:
    """A v11 segment's name and the text of its arguments, once `[ARGS]` or `{` ended the name."""
    cut = [i for i in (segment.find(ARGS), segment.find("{")) if i >= 0]
    if not cut:
        return None
    return segment[: min(cut)].strip(), segment[min(cut) + (len(ARGS) if segment.startswith(ARGS, min(cut)) else 0):]


def _segment_calls(segment: str) -> list[FunctionCall]:
    stripped = segment.lstrip()
    if _is_pre_v11(segment):  # pre-v11: a JSON list (or one object) of {"name", "arguments"}
        parsed = first_json(stripped)
        if parsed is None:
            return []
        items = parsed[0] if isinstance(parsed[0], list) else [parsed[0]]
        return [
            FunctionCall(item["name"], _pre_v11_arguments(item.get("arguments")))
            for item in items
            if isinstance(item, dict) and isinstance(item.get("name"), str)
        ]
    name_args = _name_end(segment)
    parsed = first_json(name_args[1]) if name_args else None
    if not name_args or not name_args[0] or parsed is None:
        return []
    name, args_text = name_args
    lead = len(args_text) - len(args_text.lstrip())
    return [FunctionCall(name, args_text[lead : parsed[1]])]


@dataclass(frozen=True)
class MistralFormat:
    name: str = "mistral"
    new_id: IdFactory = mistral_call_id
    triggers: str = '['  # first characters of the markers (see ToolFormat)
    prefix_content: bool = True  # see ToolFormat

    def scan(self, text: str, final: bool, tools: list | None) -> Scan:
        content, start = split_at(text, TOOL_CALLS, final)
        segments = text[start:].split(TOOL_CALLS)[1:] if start >= 0 else []
        return Scan(content, [call for segment in segments for call in _segment_calls(segment)])

    def progress(self, text: str, final: bool, tools: list | None, memo: dict | None = None) -> list[CallProgress]:
        """The calls `scan` finds, and a last v11 call still open: its name (once ended) and its
        arguments as written so far, as far as they are valid JSON (`memo` keeps its JsonHead)."""
        memo = {} if memo is None else memo
        start = text.find(TOOL_CALLS)
        if start < 0:
            return []
        segments = text[start:].split(TOOL_CALLS)[1:]
        last = segments[-1]
        closed = segments[:-1] if not final and not _is_pre_v11(last) else segments
        calls = [CallProgress(call.name, call.arguments) for segment in closed for call in _segment_calls(segment)]
        if closed is segments:
            return calls  # all closed (final), or pre-v11: whole calls only
        open_at = len(text) - len(last)
        open_text = last[: len(last) - held_back(last, (TOOL_CALLS,))]
        complete = _segment_calls(open_text)  # as `scan` has it (JsonHead stops at a repeated key)
        name_args = _name_end(open_text)
        if complete:
            calls += [CallProgress(call.name, call.arguments) for call in complete]
        elif name_args and name_args[0]:
            head = memo.setdefault(open_at, JsonHead())
            calls.append(CallProgress(name_args[0], raw_head(head, name_args[1], final)))
        return calls
