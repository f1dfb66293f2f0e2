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
from token_proxy.tools.formats.scan import Scan, content_before, dump_arguments

TOOL_START, FUNC_PREFIX, FUNC_END = "<tool_call>", "<function=", "</function>"
_FUNCTION = re.compile(r"<function=(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


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
        if kind in ("string", "str", "text", "varchar", "char", "enum"):
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
