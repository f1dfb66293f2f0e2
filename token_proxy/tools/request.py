"""What a chat request's `tools` / `tool_choice` mean, as vLLM 0.33 decides it.

- `validate_tools`: vLLM's ChatCompletionRequest.check_tool_usage and the renderer's
  parser checks, as 400s naming the parameter.
- `constraint_for`: the SGLang sampling_params that force a call ("required", a named
  function), from vLLM's get_json_schema_from_tools.
- `output_parsing`: how to parse the completion (tool format, reasoning, forced JSON).
- `finish_reason`: vLLM's resolve_finish_reason.
"""

from __future__ import annotations

import json

from token_proxy.errors import InvalidRequest
from token_proxy.tools.formats import TOOL_PARSERS, NamedFormat, RequiredFormat
from token_proxy.tools.output_parser import OutputParsing
from token_proxy.tools.reasoning import REASONING_PARSERS

_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def effective_tool_choice(tools: list | None, tool_choice: object) -> object:
    """vLLM's defaults: "auto" when tools come without a tool_choice, else "none"."""
    if tool_choice is None:
        return "auto" if tools else "none"
    return tool_choice


def named_function(tool_choice: object) -> str | None:
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def validate_tools(
    tools: list | None, tool_choice: object, *, tool_parser: str | None, auto_tool_choice: bool
) -> None:
    """Raise InvalidRequest (400, with param) where vLLM 0.33 refuses the request.

    `tool_choice` is the raw request value (None when absent). `tool_parser` is the
    configured --tool-call-parser; `auto_tool_choice` is --enable-auto-tool-choice.
    """
    _check_tools(tools)
    choice = effective_tool_choice(tools, tool_choice)
    if choice == "none":
        return
    if not tools:
        raise InvalidRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise InvalidRequest(
            f"Invalid value for `tool_choice`: {choice}! "
            'Only named tools, "none", "auto" or "required" are supported.',
            param="tool_choice",
        )
    if isinstance(choice, dict):
        _check_named(tools, choice)
    _check_parser(choice, tool_parser, auto_tool_choice)


def _check_tools(tools: object) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequest("`tools` must be an array of tool objects.", param="tools")
    if not tools:
        raise InvalidRequest(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                                 param="tools")
        if tool.get("type", "function") != "function":
            raise InvalidRequest(f"tools[{i}].type must be \"function\"", param="tools")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be an object", param="tools")


def _check_named(tools: list, choice: dict) -> None:
    function = choice.get("function")
    if not isinstance(function, dict):
        raise InvalidRequest(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_USAGE}", param="tool_choice.function"
        )
    if "name" not in function:
        raise InvalidRequest(
            f"Expected field `name` in `function` in `tool_choice`! {_USAGE}", param="tool_choice.function.name"
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise InvalidRequest(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_USAGE}", param="tool_choice.function.name"
        )
    if not any(tool["function"]["name"] == name for tool in tools):
        raise InvalidRequest(
            "The tool specified in `tool_choice` does not match any of the specified `tools`", param="tool_choice"
        )


def _check_parser(choice: object, tool_parser: str | None, auto_tool_choice: bool) -> None:
    """online_renderer.render_chat: vLLM builds no tool parser without --enable-auto-tool-choice."""
    if tool_parser is not None and auto_tool_choice:
        return
    if choice == "auto":
        raise InvalidRequest(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            param="tool_choice",
        )
    described = f'function "{named_function(choice)}"' if isinstance(choice, dict) else f'"{choice}"'
    raise InvalidRequest(f"tool_choice={described} requires --tool-call-parser to be set", param="tool_choice")


def constraint_for(tools: list | None, tool_choice: object, parallel_tool_calls: bool | None = True) -> dict | None:
    """SGLang sampling_params forcing the call, or None (auto / none).

    vLLM's guided-decoding schema: "required" → an array (minItems 1; maxItems 1 when
    parallel_tool_calls is false) of {"name": <enum of one tool>, "parameters": <its schema>};
    a named function → that function's parameters schema. `$defs` of all tools are hoisted.
    """
    choice = effective_tool_choice(tools, tool_choice)
    if not tools or choice in ("auto", "none"):
        return None
    if isinstance(choice, dict):
        function = next(t["function"] for t in tools if t["function"]["name"] == named_function(choice))
        schema = _parameters(function)
    else:
        schema = _required_schema(tools, parallel_tool_calls)
    return {"json_schema": json.dumps(schema, ensure_ascii=False)}


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _required_schema(tools: list, parallel_tool_calls: bool | None) -> dict:
    defs: dict = {}
    items = []
    for tool in tools:
        params = dict(_parameters(tool["function"]))
        for name, schema in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise InvalidRequest(
                    f"Tool definition '{name}' has multiple schemas, which is not supported.", param="tools"
                )
            defs[name] = schema
        items.append({
            "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]}, "parameters": params},
            "required": ["name", "parameters"],
        })
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tools_for_template(tools: list | None, tool_choice: object, exclude_when_none: bool = False) -> list | None:
    """The tools the chat template renders: all of them, even for "none", unless
    vLLM's --exclude-tools-when-tool-choice-none is set."""
    if exclude_when_none and effective_tool_choice(tools, tool_choice) == "none":
        return None
    return tools


def output_parsing(
    tools: list | None,
    tool_choice: object,
    *,
    tool_parser: str | None,
    auto_tool_choice: bool,
    reasoning_parser: str | None = None,
    chat_template_kwargs: dict | None = None,
    parallel_tool_calls: bool | None = True,
    include_reasoning: bool = True,
    tool_call_streaming: str = "fragments",
) -> OutputParsing:
    """How to parse this request's completions (call after validate_tools).

    `tool_parser`, `auto_tool_choice`, `reasoning_parser` and `tool_call_streaming` are the server's flags; the rest
    are the request's fields (tool_choice raw: None when absent).
    """
    choice = effective_tool_choice(tools, tool_choice)
    forced = choice == "required" or isinstance(choice, dict)
    if forced:
        # A forced call is constrained by a json_schema grammar from its first token (vLLM's grammar
        # waits for the end of thinking; SGLang's /generate gets no such hint), so its output has no
        # reasoning to split off: a reasoning parser would take the whole call for thinking.
        reasoning_parser = None
    think = REASONING_PARSERS.get(reasoning_parser) if reasoning_parser else None
    if think is not None and not think.thinking(chat_template_kwargs):
        think = None
    if isinstance(choice, dict):
        tool_format = NamedFormat(named_function(choice))
    elif choice == "required":
        tool_format = RequiredFormat()
    elif choice == "auto" and tools and auto_tool_choice and tool_parser:
        tool_format = TOOL_PARSERS[tool_parser]
    else:
        tool_format = None
    return OutputParsing(
        tool_format=tool_format,
        reasoning=think,
        tools=tools,
        forced=forced,
        single_call=parallel_tool_calls is False,
        include_reasoning=include_reasoning,
        hides_token_metadata=not include_reasoning and bool((tool_parser and auto_tool_choice) or reasoning_parser),
        tool_call_streaming=tool_call_streaming,
    )


def sampling_overrides(parsing: OutputParsing) -> dict:
    """SGLang sampling_params a parsed request needs: tool-call markers are special tokens in
    several families ([TOOL_CALLS], <|python_tag|>, DeepSeek's), and SGLang's default
    skip_special_tokens=True would strip them from the text (vLLM's parsers set it false too)."""
    return {"skip_special_tokens": False} if parsing.tool_format is not None else {}


def finish_reason(engine_finish_reason: str | None, tool_choice: object, has_tool_calls: bool) -> str:
    """vLLM's resolve_finish_reason: "tool_calls" only for calls made on a natural stop, and not
    for a named function (OpenAI says "stop" there); "length" stays "length"."""
    reason = engine_finish_reason or "stop"
    if has_tool_calls and reason == "stop" and not isinstance(tool_choice, dict):
        return "tool_calls"
    return reason


def check_flags(tool_call_parser: str | None, enable_auto_tool_choice: bool, reasoning_parser: str | None) -> None:
    """Startup checks on the three flags (vLLM's wording where vLLM has one); ValueError for the CLI."""
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("Error: --enable-auto-tool-choice requires --tool-call-parser")
    if tool_call_parser and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {tool_call_parser!r} is not one of {', '.join(sorted(TOOL_PARSERS))}")
    if reasoning_parser and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser {reasoning_parser!r} is not one of {', '.join(sorted(REASONING_PARSERS))}"
        )
