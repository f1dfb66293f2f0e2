"""tools/tool_choice validation (vLLM 0.33's 400s), the forced-call constraint, finish_reason, template detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from token_proxy.errors import InvalidRequest
from token_proxy.simulator.builtin_tokenizer import CHAT_TEMPLATE
from token_proxy.tools import (
    choose_tool_parser,
    constraint_for,
    finish_reason,
    parser_for_template,
    tools_for_template,
    validate_tools,
)

TEMPLATES = Path(__file__).parents[1] / "templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]
USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def refused(tools, tool_choice, parser="hermes", auto=True) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        validate_tools(tools, tool_choice, tool_parser=parser, auto_tool_choice=auto)
    assert info.value.status == 400 and info.value.body()["error"]["type"] == "BadRequestError"
    return info.value


@pytest.mark.parametrize("tools, choice, param, message", [
    ([], None, "tools",
     "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely."),
    (None, "auto", "tool_choice", "When using `tool_choice`, `tools` must be set."),
    (None, "required", "tool_choice", "When using `tool_choice`, `tools` must be set."),
    (TOOLS, "sometimes", "tool_choice",
     'Invalid value for `tool_choice`: sometimes! Only named tools, "none", "auto" or "required" are supported.'),
    (TOOLS, {"type": "function"}, "tool_choice.function",
     f"Invalid value for `function`: `None` in `tool_choice`! {USAGE}"),
    (TOOLS, {"type": "function", "function": {}}, "tool_choice.function.name",
     f"Expected field `name` in `function` in `tool_choice`! {USAGE}"),
    (TOOLS, {"type": "function", "function": {"name": ""}}, "tool_choice.function.name",
     f"Invalid `name` in `function`: `` in `tool_choice`! {USAGE}"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice",
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
    ([{"function": "x"}], None, "tools", None),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools", None),
    ([{"type": "code", "function": {"name": "f"}}], None, "tools", None),
])
def test_bad_tool_requests_are_400_naming_the_param(tools, choice, param, message):
    error = refused(tools, choice)
    assert error.param == param
    if message is not None:
        assert error.message == message


def test_parser_needed_as_vllm_says():
    # tools without tool_choice mean "auto" (vLLM's default), which needs both flags
    error = refused(TOOLS, None, parser=None, auto=False)
    assert error.message == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    assert refused(TOOLS, "auto", parser="hermes", auto=False).param == "tool_choice"
    assert refused(TOOLS, "required", parser=None, auto=False).message == (
        'tool_choice="required" requires --tool-call-parser to be set')
    named = {"type": "function", "function": {"name": "now"}}
    assert refused(TOOLS, named, parser="hermes", auto=False).message == (
        'tool_choice=function "now" requires --tool-call-parser to be set')


@pytest.mark.parametrize("tools, choice", [
    (TOOLS, None), (TOOLS, "auto"), (TOOLS, "required"), (TOOLS, "none"), (None, None), (None, "none"),
    (TOOLS, {"type": "function", "function": {"name": "get_weather"}}),
])
def test_accepted_with_a_parser(tools, choice):
    validate_tools(tools, choice, tool_parser="hermes", auto_tool_choice=True)


def test_none_needs_no_parser():
    validate_tools(TOOLS, "none", tool_parser=None, auto_tool_choice=False)
    validate_tools(None, None, tool_parser=None, auto_tool_choice=False)


def test_required_constraint_is_vllms_schema():
    constraint = constraint_for(TOOLS, "required")
    assert list(constraint) == ["json_schema"] and isinstance(constraint["json_schema"], str)
    assert json.loads(constraint["json_schema"]) == {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["now"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]},
        ]},
    }
    assert json.loads(constraint_for(TOOLS, "required", parallel_tool_calls=False)["json_schema"])["maxItems"] == 1


def test_named_constraint_is_the_parameters_schema():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert json.loads(constraint_for(TOOLS, named)["json_schema"]) == WEATHER
    empty = {"type": "function", "function": {"name": "now"}}
    assert json.loads(constraint_for(TOOLS, empty)["json_schema"]) == {"type": "object", "properties": {}}


def test_no_constraint_for_auto_and_none():
    assert constraint_for(TOOLS, "auto") is None
    assert constraint_for(TOOLS, None) is None
    assert constraint_for(TOOLS, "none") is None
    assert constraint_for(None, None) is None


def test_defs_are_hoisted_and_conflicts_refused():
    item = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"i": {"$ref": "#/$defs/Item"}}, "$defs": {"Item": item}}}}]
    schema = json.loads(constraint_for(tools, "required")["json_schema"])
    assert schema["$defs"] == {"Item": item}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in tools[0]["function"]["parameters"]  # the request's tools are left alone
    clash = tools + [{"type": "function", "function": {"name": "b", "parameters": {"$defs": {"Item": {}}}}}]
    with pytest.raises(InvalidRequest) as info:
        constraint_for(clash, "required")
    assert info.value.param == "tools"


@pytest.mark.parametrize("engine, choice, calls, expected", [
    ("stop", "auto", True, "tool_calls"),
    ("stop", "required", True, "tool_calls"),
    ("stop", {"type": "function", "function": {"name": "x"}}, True, "stop"),
    ("length", "auto", True, "length"),
    ("stop", "auto", False, "stop"),
    (None, "auto", True, "tool_calls"),
    ("abort", "auto", True, "abort"),
])
def test_finish_reason(engine, choice, calls, expected):
    assert finish_reason(engine, choice, calls) == expected


def test_none_still_renders_tools_unless_excluded():
    assert tools_for_template(TOOLS, "none") == TOOLS
    assert tools_for_template(TOOLS, "none", exclude_when_none=True) is None
    assert tools_for_template(TOOLS, "auto", exclude_when_none=True) == TOOLS


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3"])
def test_template_names_its_parser(name):
    assert parser_for_template((TEMPLATES / f"{name}.jinja").read_text()) == name


def test_template_detection_edges(caplog):
    assert parser_for_template(CHAT_TEMPLATE) == "hermes"  # the simulator's built-in Qwen2.5 template
    assert parser_for_template(None) is None
    assert parser_for_template("{{ messages[0].content }}") is None
    v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ name }}<｜tool▁sep｜>{{ args }}"
    assert parser_for_template(v31) is None  # DeepSeek V3.1's layout: not deepseek_v3
    caplog.set_level("INFO", logger="token_proxy.tools.template_detect")
    assert choose_tool_parser("mistral", CHAT_TEMPLATE) == "mistral"
    assert choose_tool_parser(None, CHAT_TEMPLATE) == "hermes"
    assert "detected from the chat template" in caplog.text


def test_flag_checks():
    from token_proxy.tools import check_flags

    check_flags(None, False, None)
    check_flags("hermes", True, "qwen3")
    check_flags("hermes", False, None)  # parser without auto: "required"/named still refused per request
    with pytest.raises(ValueError, match="^Error: --enable-auto-tool-choice requires --tool-call-parser$"):
        check_flags(None, True, None)
    with pytest.raises(ValueError, match="--tool-call-parser 'nope' is not one of deepseek_v3, hermes"):
        check_flags("nope", True, None)
    with pytest.raises(ValueError, match="--reasoning-parser 'r2'"):
        check_flags(None, False, "r2")
