"""ChatFeatures.for_request (issue 21): None for a plain chat, so it never enters tools/ or sessions/; otherwise
what vLLM's rules make of its tools, reasoning parser and session."""

from __future__ import annotations

import pytest

from token_proxy.api.chat import parse_chat_request
from token_proxy.api.chat.request import ChatFeatures, ToolFlags
from token_proxy.errors import InvalidRequest

VOCAB = 1000
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
HERMES = ToolFlags(tool_call_parser="hermes", enable_auto_tool_choice=True)
NO_FLAGS = ToolFlags()


def features(body: dict, headers: dict | None = None, flags: ToolFlags = NO_FLAGS):
    body = {"model": "m", "messages": USER, **body}
    return ChatFeatures.for_request(parse_chat_request(body, VOCAB, flags), body, headers or {}, flags)


@pytest.mark.parametrize("body", [{}, {"tool_choice": "none"}, {"tools": None}, {"include_reasoning": False}])
def test_a_plain_chat_has_no_features(body):
    assert features(body) is None


def test_tools_give_the_parser_and_skip_special_tokens():
    got = features({"tools": [TOOL]}, flags=HERMES)
    assert got.parsing.tool_format is not None and got.parsing.tools == [TOOL]
    assert got.sampling_overrides == {"skip_special_tokens": False}
    assert got.session_key is None


def test_a_forced_call_is_a_json_schema_constraint():
    got = features({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                   flags=HERMES)
    assert got.sampling_overrides == {"json_schema": '{"type": "object"}', "skip_special_tokens": False}
    assert got.parsing.forced is True


def test_tool_history_alone_is_a_feature_and_its_arguments_become_objects():
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    body = {"model": "m", "messages": messages}
    req = parse_chat_request(body, VOCAB)
    assert req.prompt.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    got = ChatFeatures.for_request(req, body, {}, ToolFlags())
    assert got is not None and got.parsing.tool_format is None and got.sampling_overrides == {}


def test_a_reasoning_parser_is_a_feature():
    got = features({}, flags=ToolFlags(reasoning_parser="qwen3"))
    assert got is not None and got.parsing.reasoning is not None


def test_include_reasoning_false_under_a_tool_parser_hides_token_metadata():
    got = features({"include_reasoning": False}, flags=HERMES)
    assert got is not None and got.parsing.hides_token_metadata is True


def test_a_session_id_is_a_feature_and_is_checked():
    assert features({}, {"X-Session-ID": "s-1"}).session_key == "s-1"
    assert features({"session_id": "s-2"}).session_key == "s-2"
    assert features({}, {"X-Session-ID": ""}) is None
    with pytest.raises(InvalidRequest) as err:
        features({"session_id": 7})
    assert err.value.param == "session_id"
    # a route without sessions (headers None) does not look at the session id at all
    body = {"model": "m", "messages": USER, "session_id": 7}
    assert ChatFeatures.for_request(parse_chat_request(body, VOCAB), body, None, ToolFlags()) is None


def test_tool_choice_without_tools_is_still_refused():
    with pytest.raises(InvalidRequest) as err:
        features({"tool_choice": "auto"})
    assert err.value.param == "tool_choice"
