"""qwen3_coder (vLLM alias qwen3_xml): Qwen3-Coder / Qwen3.5's XML calls.

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

Content is the text before the first `<tool_call>` (or a bare `<function=`). A call is
complete at `</function>`. Parameter values lose one leading and one trailing newline and
are converted by the tool's JSON-schema type, as vLLM's and SGLang's Qwen3-Coder parsers do.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from token_proxy.tools.calls import FunctionCall, IdFactory, vllm_call_id
from token_proxy.tools.formats.scan import CallProgress, Scan, content_before, dump_arguments, held_back

TOOL_START, FUNC_PREFIX, FUNC_END = "<tool_call>", "<function=", "</function>"
_FUNCTION = re.compile(r"<function=(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
PARAM_END, PARAM_PREFIX = "</parameter>", "<parameter="
_STRING_KINDS = ("string", "str", "text", "varchar", "char", "enum")


def _param_types(name: str, tools: list | None) -> dict:
    for tool in tools or ():
        function = tool.get("function") or {}
        if function.get("name") == name:
            params = function.get("parameters") or {}
            return params.get("properties", params) if isinstance(params, dict) else {}
    return {}


def _schema_type(schema: object) -> str:
    if not isinstance(schema, dict):
        return "string"
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind is None:
        for key in ("anyOf", "oneOf"):
            options = [_schema_type(s) for s in schema.get(key, ()) if isinstance(s, dict)]
            kind = next((k for k in options if k != "null"), None)
            if kind:
                break
    if kind is None and "enum" in schema:
        kind = "string"
    return str(kind or "string").strip().lower()


def convert_value(value: str, schema: object, known: bool) -> object:
    """A parameter's text as the JSON value its schema type asks for (SGLang/vLLM's rules)."""
    if value.lower() == "null":
        return None
    if not known:
        return value
    kind = _schema_type(schema)
    try:
        if kind in _STRING_KINDS:
            return value
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            integral = "." not in value and "e" not in value.lower()
            return int(number) if integral and number.is_integer() else number
        if kind in ("boolean", "bool", "binary"):
            return value.lower() == "true"
        if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                pass
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _call(body: str, tools: list | None) -> FunctionCall | None:
    if ">" not in body:
        return None
    name, params_text = body.split(">", 1)
    types = _param_types(name, tools)
    arguments = {}
    for match in _PARAMETER.findall(params_text):
        if ">" not in match:
            continue
        param, value = match.split(">", 1)
        value = value.removeprefix("\n")
        value = value.removesuffix("\n")
        arguments[param] = convert_value(value, types.get(param), param in types)
    return FunctionCall(name, dump_arguments(arguments))


@dataclass(frozen=True)
class Qwen3CoderFormat:
    name: str = "qwen3_coder"
    new_id: IdFactory = vllm_call_id
    triggers: str = '<'  # first characters of the markers (see ToolFormat)
    prefix_content: bool = True  # see ToolFormat

    def scan(self, text: str, final: bool, tools: list | None) -> Scan:
        starts = [i for i in (text.find(TOOL_START), text.find(FUNC_PREFIX)) if i >= 0]
        start = min(starts) if starts else -1
        content = content_before(text, start, final, (TOOL_START, FUNC_PREFIX))
        if start < 0:
            return Scan(content)
        calls = [_call(body, tools) for body in _FUNCTION.findall(text, start)]
        return Scan(content, [call for call in calls if call is not None])

    def progress(self, text: str, final: bool, tools: list | None, memo: dict | None = None) -> list[CallProgress]:
        """Each `<function=NAME>` region: closed ones parsed (as `scan`), the open one's arguments
        as far as they are fixed (see _open_arguments; `memo`, the stream's, keeps its closed parameters)."""
        memo = {} if memo is None else memo
        calls = []
        pos = text.find(FUNC_PREFIX)
        while pos >= 0:
            body_start = pos + len(FUNC_PREFIX)
            end = text.find(FUNC_END, body_start)
            if end < 0:
                body = text[body_start:]
                body = body[: len(body) - held_back(body, (FUNC_END,))]
                if ">" in body:
                    name, params_text = body.split(">", 1)
                    calls.append(CallProgress(name, _open_arguments(name, params_text, tools, memo, body_start)))
                break
            call = _call(text[body_start:end], tools)
            if call is not None:
                calls.append(CallProgress(call.name, call.arguments))
            pos = text.find(FUNC_PREFIX, end + len(FUNC_END))
        return calls


def _open_arguments(name: str, params_text: str, tools: list | None, memo: dict, key: int) -> str:
    """The fixed head of json.dumps(arguments) while `</function>` has not come.

    Closed parameters are converted as `_call` converts them (and kept in `memo[key]`, so a
    stream looks at each once). The open one gives its key, and its value only where the value
    is a string whatever comes (the schema says string, or the parameter is not in it): then its
    text so far is final, except trailing newlines (up to two go at the end), a marker's
    beginning, and a value that may still read "null" (which becomes null). Other values
    (numbers, objects, ...) are sent once closed, as vLLM's Qwen3 parser does. A repeated
    parameter stops the head (the final dict puts its last value at the first place).
    """
    types = _param_types(name, tools)
    seen, pos, closed = memo.get(key) or ("", 0, {})
    if not params_text.startswith(seen):
        pos, closed = 0, {}
    open_key = open_value = None
    # _PARAMETER's split, with str.find: a parameter ends at `</parameter>` or the next `<parameter=`.
    while (start := params_text.find(PARAM_PREFIX, pos)) >= 0:
        value_start = start + len(PARAM_PREFIX)
        close, after = params_text.find(PARAM_END, value_start), params_text.find(PARAM_PREFIX, value_start)
        if close >= 0 and (after < 0 or close < after):
            param_text, pos = params_text[value_start:close], close + len(PARAM_END)
        elif after >= 0:
            param_text, pos = params_text[value_start:after], after
        else:
            if ">" in params_text[value_start:]:
                open_key, open_value = params_text[value_start:].split(">", 1)
            break
        if ">" in param_text:
            param, value = param_text.split(">", 1)
            if param in closed:  # a repeated parameter: its value goes to the first place
                return dump_arguments(closed)[:-1]
            closed = {**closed, param: convert_value(value.removeprefix("\n").removesuffix("\n"),
                                                     types.get(param), param in types)}
        memo[key] = (params_text[:pos], pos, closed)
    if not closed and open_key is None:
        return ""
    head = dump_arguments(closed)[:-1]
    if open_key is None or open_key in closed:
        return head
    head += (", " if closed else "") + dump_arguments(open_key) + ": "
    if open_key in types and _schema_type(types[open_key]) not in _STRING_KINDS:
        return head
    value = open_value.removeprefix("\n")
    value = value[: len(value) - held_back(value, (PARAM_END, PARAM_PREFIX))].removesuffix("\n").removesuffix("\n")
    if "null".startswith(value.lower()):
        return head
    return head + dump_arguments(value)[:-1]
