"""/openapi.json says what the parsers say: bodies schemathesis found on either side of the line (ST201/ST202).

tests/api/test_fuzz.py's schemathesis run finds such disagreements at random; these are the ones it found,
each checked against the document (jsonschema) and the parser's answer, so none comes back unnoticed.
"""

from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator

from token_proxy.ops.openapi import ALL_TOOL_CHOICES, Limits, openapi_spec, tool_choices

MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]


def valid(path: str, body: dict, limits: Limits) -> bool:
    spec = openapi_spec(limits)
    pointer = "#/paths/" + path.replace("/", "~1") + "/post/requestBody/content/application~1json/schema"
    return Draft202012Validator({**spec, "$ref": pointer}).is_valid(body)


NO_TOOLS = Limits("m", 1000, 128, tool_choices(None, False))
AUTO = Limits("m", 1000, 128, tool_choices("hermes", True))


def test_tool_choices_follow_the_flags():
    assert tool_choices(None, False) == tool_choices(None, True) == tool_choices("hermes", False) == ()
    assert tool_choices("hermes", True) == ALL_TOOL_CHOICES


@pytest.mark.parametrize(("extra", "without_parser", "with_parser"), [
    ({}, True, True),
    ({"tools": TOOLS}, False, True),  # no tool_choice means "auto"
    ({"tools": TOOLS, "tool_choice": "auto"}, False, True),
    ({"tools": TOOLS, "tool_choice": "required"}, False, True),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, False, True),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ""}}}, False, False),
    ({"tools": TOOLS, "tool_choice": "none"}, True, True),
])
def test_tool_choice_is_described_for_the_configured_proxy(extra, without_parser, with_parser):
    body = {"messages": MESSAGES, **extra}
    assert valid("/v1/chat/completions", body, NO_TOOLS) is without_parser
    assert valid("/v1/chat/completions", body, AUTO) is with_parser


@pytest.mark.parametrize(("sampling", "ok"), [
    ({"structured_outputs": {"regex": "a"}}, True),
    ({"structured_outputs": {"json": []}}, False),  # vLLM's json: a str or a dict
    ({"structured_outputs": {"json": {"type": "object"}}}, True),
    ({"structured_outputs": {"regex": "a", "grammar": []}}, False),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, False),
    ({"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}}, True),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, False),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, True),
    ({"min_tokens": 129}, False),
])
def test_sampling_rules_are_described(sampling, ok):
    assert valid("/inference/v1/generate", {"token_ids": [1], "sampling_params": sampling}, NO_TOOLS) is ok
    assert valid("/v1/completions", {"prompt": "hi", **sampling}, NO_TOOLS) is ok


@pytest.mark.parametrize("structured", [{"json": []}, {"json": 5}, {"regex": "a", "grammar": []},
                                        {"grammar": 5}])
def test_the_parser_refuses_what_vllm_refuses(structured):
    from token_proxy.api.sampling import _constraint_from_structured
    from token_proxy.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as info:
        _constraint_from_structured(structured)
    assert info.value.param == "structured_outputs"
