"""Tool-call and reasoning parsers: vLLM 0.33's shapes, and streaming == non-streaming for the same text."""

from __future__ import annotations

import json
import random
import re

import pytest

from token_proxy.tools import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    OutputParsing,
    merge_deltas,
    output_parsing,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
                       "metric": {"type": "boolean"}, "filters": {"type": "object"}, "tags": {"type": "array"}},
    }}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}},
]
VLLM_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{16}$")
NESTED = {"city": "Zürich 東京", "filters": {"a": [1, {"b": None}], "emoji": "🌧"}}


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def run_stream(parsing: OutputParsing, pieces: list[str]):
    stream = parsing.stream()
    events = [event for piece in pieces for event in stream.feed(piece)]
    events += stream.finish()
    return stream, events


def splits(text: str):
    """The text fed whole, char by char, cut once at every boundary, and cut at random places."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def assert_stream_matches(parsing: OutputParsing, text: str):
    """Every way of streaming `text` yields the calls, reasoning and content `parse` finds."""
    parsed = parsing.parse(text)
    for pieces in splits(text):
        stream, events = run_stream(parsing, pieces)
        delta = merge_deltas(events)
        got_calls = [(c.name, c.arguments) for c in stream.tool_calls]
        assert got_calls == [(c.name, c.arguments) for c in parsed.tool_calls], pieces
        assert delta.get("reasoning", "") == (parsed.reasoning or ""), pieces
        streamed = delta.get("content", "")
        if parsed.content is None:
            assert not streamed.strip(), pieces
        else:
            assert streamed == parsed.content, pieces
        assert stream.finished.content == parsed.content
        # vLLM's delta order per call: header {index, id, type, function.name}, then arguments
        tool_events = [e for e in events if e.kind in ("tool_call", "arguments")]
        for i in range(len(parsed.tool_calls)):
            header, args = tool_events[2 * i], tool_events[2 * i + 1]
            assert header.tool_call_delta() == {
                "index": i, "id": stream.tool_calls[i].id, "type": "function",
                "function": {"name": parsed.tool_calls[i].name}}
            assert args.tool_call_delta() == {"index": i, "function": {"arguments": parsed.tool_calls[i].arguments}}
    return parsed


def auto(parser: str, reasoning: str | None = None, **kw) -> OutputParsing:
    return output_parsing(TOOLS, "auto", tool_parser=parser, auto_tool_choice=True, reasoning_parser=reasoning, **kw)


# --- hermes ---------------------------------------------------------------------------------------

def hermes_call(name, args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args}, ensure_ascii=False)}\n</tool_call>'


def test_hermes_text_before_two_calls_and_after():
    text = "Let me check.\n" + hermes_call("get_weather", NESTED) + "\n" + hermes_call("search", {"query": "x"}) + "\nbye"
    parsed = assert_stream_matches(auto("hermes"), text)
    assert parsed.content == "Let me check.\n"  # vLLM: only the text before the first call
    assert calls_of(parsed) == [("get_weather", NESTED), ("search", {"query": "x"})]
    assert all(VLLM_ID.match(c.id) for c in parsed.tool_calls)
    assert parsed.tool_calls[0].arguments == json.dumps(NESTED, ensure_ascii=False)
    assert parsed.tool_calls[0].to_openai() == {
        "id": parsed.tool_calls[0].id, "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(NESTED, ensure_ascii=False)}}


def test_hermes_call_only_has_null_content():
    parsed = assert_stream_matches(auto("hermes"), hermes_call("search", {"query": "q"}))
    assert parsed.content is None and calls_of(parsed) == [("search", {"query": "q"})]
    assert parsed.message_fields()["content"] is None


def test_hermes_no_call_is_plain_content():
    parsed = assert_stream_matches(auto("hermes"), "Just text with a < sign and <tool_ not a tag")
    assert parsed.content == "Just text with a < sign and <tool_ not a tag" and parsed.tool_calls == []
    assert "tool_calls" not in parsed.message_fields()


def test_hermes_truncated_call_emits_no_broken_json():
    text = "Sure " + hermes_call("get_weather", NESTED)[:-30]
    parsed = assert_stream_matches(auto("hermes"), text)
    assert parsed.tool_calls == [] and parsed.content == "Sure "
    _, events = run_stream(auto("hermes"), list(text))
    assert not [e for e in events if e.kind in ("tool_call", "arguments")]


def test_hermes_complete_call_cut_before_its_end_tag_counts_at_the_end():
    text = '<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n</tool_'
    parsed = assert_stream_matches(auto("hermes"), text)
    assert calls_of(parsed) == [("search", {"query": "a"})]


def test_hermes_malformed_call_is_dropped():
    text = hermes_call("search", {"query": "ok"}) + "<tool_call>\n{not json}\n</tool_call>"
    assert calls_of(assert_stream_matches(auto("hermes"), text)) == [("search", {"query": "ok"})]


def test_hermes_with_qwen3_reasoning():
    text = "<think>\nThe user wants weather.\n</think>\n\n" + hermes_call("get_weather", {"city": "Oslo"})
    parsed = assert_stream_matches(auto("hermes", "qwen3"), text)
    assert parsed.reasoning == "\nThe user wants weather.\n"
    assert parsed.content is None and calls_of(parsed) == [("get_weather", {"city": "Oslo"})]


def test_qwen3_tool_call_ends_reasoning_without_think_end():
    text = "thinking... " + hermes_call("search", {"query": "q"})
    parsed = assert_stream_matches(auto("hermes", "qwen3"), text)
    assert parsed.reasoning == "thinking... " and calls_of(parsed) == [("search", {"query": "q"})]


def test_parallel_tool_calls_false_keeps_the_first():
    text = hermes_call("search", {"query": "1"}) + hermes_call("search", {"query": "2"})
    parsed = assert_stream_matches(auto("hermes", parallel_tool_calls=False), text)
    assert calls_of(parsed) == [("search", {"query": "1"})]


# --- qwen3_coder -----------------------------------------------------------------------------------

def coder_call(name, params: dict[str, str]):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_converts_values_by_schema():
    text = "Checking.\n" + coder_call("get_weather", {
        "city": "Zürich\nline2", "days": "3", "scale": "2", "metric": "True",
        "filters": '{"a": [1, {"b": null}]}', "tags": "['x', 'y']", "unknown": "42"}) + coder_call("search", {"query": "null"})
    parsed = assert_stream_matches(auto("qwen3_coder"), text)
    assert parsed.content == "Checking.\n"
    assert calls_of(parsed) == [
        ("get_weather", {"city": "Zürich\nline2", "days": 3, "scale": 2, "metric": True,
                         "filters": {"a": [1, {"b": None}]}, "tags": ["x", "y"], "unknown": "42"}),
        ("search", {"query": None}),
    ]


def test_qwen3_coder_truncated_and_with_reasoning():
    text = "<think>plan</think>" + coder_call("search", {"query": "a"}) + coder_call("search", {"query": "b"})[:40]
    parsed = assert_stream_matches(auto("qwen3_coder", "qwen3"), text)
    assert parsed.reasoning == "plan" and calls_of(parsed) == [("search", {"query": "a"})]


# --- llama3_json ---------------------------------------------------------------------------------

def test_llama3_python_tag_and_several_calls():
    text = '<|python_tag|>{"name": "search", "parameters": {"query": "ü"}}; {"name": "get_weather", "arguments": ' \
           + json.dumps(NESTED, ensure_ascii=False) + "}"
    parsed = assert_stream_matches(auto("llama3_json"), text)
    assert parsed.content is None
    assert calls_of(parsed) == [("search", {"query": "ü"}), ("get_weather", NESTED)]


def test_llama3_plain_json_answer_and_prose_stay_content():
    assert assert_stream_matches(auto("llama3_json"), '{"answer": 42}').content == '{"answer": 42}'
    parsed = assert_stream_matches(auto("llama3_json"), 'The {"name": "x"} thing')
    assert parsed.content == 'The {"name": "x"} thing' and parsed.tool_calls == []


def test_llama3_truncated_call_is_not_content():
    parsed = assert_stream_matches(auto("llama3_json"), '{"name": "search", "parameters": {"query": "a')
    assert parsed.tool_calls == [] and parsed.content is None


# --- mistral -----------------------------------------------------------------------------------

def test_mistral_v11_calls_keep_raw_arguments_and_mistral_ids():
    text = 'Ok.[TOOL_CALLS]search[ARGS]{"query":  "a"}[TOOL_CALLS]get_weather{"city": "Oslo", "days": 2}'
    parsed = assert_stream_matches(auto("mistral"), text)
    assert parsed.content == "Ok."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("search", '{"query":  "a"}'), ("get_weather", '{"city": "Oslo", "days": 2}')]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in parsed.tool_calls)


def test_mistral_pre_v11_list_and_truncation():
    text = '[TOOL_CALLS] [{"name": "search", "arguments": {"query": "x"}}, {"name": "get_weather", "arguments": {}}]'
    assert calls_of(assert_stream_matches(auto("mistral"), text)) == [("search", {"query": "x"}), ("get_weather", {})]
    odd = '[TOOL_CALLS][{"name": "now"}, {"name": "search", "arguments": "{\\"query\\": 1}"}]'
    assert [(c.name, c.arguments) for c in assert_stream_matches(auto("mistral"), odd).tool_calls] == [
        ("now", "{}"), ("search", '{"query": 1}')]
    truncated = assert_stream_matches(auto("mistral"), '[TOOL_CALLS]search[ARGS]{"query": "x')
    assert truncated.tool_calls == [] and truncated.content is None


# --- deepseek_v3 -----------------------------------------------------------------------------------

def ds_call(name, args):
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args, ensure_ascii=False)}\n```<｜tool▁call▁end｜>"


def test_deepseek_v3_calls_and_content_around_the_block():
    text = "Before." + "<｜tool▁calls▁begin｜>" + ds_call("get_weather", NESTED) + ds_call("search", {"query": "q"}) \
        + "<｜tool▁calls▁end｜>" + " After."
    parsed = assert_stream_matches(auto("deepseek_v3"), text)
    assert parsed.content == "Before. After."
    assert calls_of(parsed) == [("get_weather", NESTED), ("search", {"query": "q"})]
    assert parsed.tool_calls[0].arguments == json.dumps(NESTED, ensure_ascii=False)


def test_deepseek_v3_truncated_with_r1_reasoning():
    text = "<think>hmm</think>" + "<｜tool▁calls▁begin｜>" + ds_call("search", {"query": "q"}) + ds_call("search", {"query": "r"})[:-25]
    parsed = assert_stream_matches(auto("deepseek_v3", "deepseek_r1"), text)
    assert parsed.reasoning == "hmm" and calls_of(parsed) == [("search", {"query": "q"})] and parsed.content is None


# --- reasoning only ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>a</think>b", "a", "b"),
    ("a</think>b", "a", "b"),  # the template opened <think>
    ("a</think>", "a", None),  # nothing after the end: null content
    ("still thinking", "still thinking", None),  # no end: all reasoning (vLLM)
])
def test_deepseek_r1_split(text, reasoning, content):
    parsing = OutputParsing(reasoning=REASONING_PARSERS["deepseek_r1"])
    parsed = assert_stream_matches(parsing, text)
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == (reasoning, content, [])


def test_qwen3_thinking_off_is_all_content():
    parsing = output_parsing(None, None, tool_parser=None, auto_tool_choice=False, reasoning_parser="qwen3",
                             chat_template_kwargs={"enable_thinking": False})
    parsed = parsing.parse("<think>x</think>y")
    assert parsed.reasoning is None and parsed.content == "<think>x</think>y"


def test_deepseek_v3_reasoning_needs_thinking_on():
    off = output_parsing(None, None, tool_parser=None, auto_tool_choice=False, reasoning_parser="deepseek_v3")
    on = output_parsing(None, None, tool_parser=None, auto_tool_choice=False, reasoning_parser="deepseek_v3",
                        chat_template_kwargs={"thinking": True})
    assert off.parse("a</think>b").content == "a</think>b"
    assert (on.parse("a</think>b").reasoning, on.parse("a</think>b").content) == ("a", "b")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_a_forced_call_has_no_reasoning_to_split_off(choice):
    """The forced call is grammar-constrained from its first token: a reasoning parser would take it
    for thinking, so the parser is off (and token metadata stays, as with no reasoning parser)."""
    parsing = output_parsing(TOOLS, choice, tool_parser=None, auto_tool_choice=False, reasoning_parser="qwen3",
                             include_reasoning=False)
    assert (parsing.reasoning, parsing.forced, parsing.hides_token_metadata) == (None, True, False)
    auto = output_parsing(TOOLS, "auto", tool_parser=None, auto_tool_choice=False, reasoning_parser="qwen3",
                          include_reasoning=False)
    assert (auto.reasoning, auto.forced, auto.hides_token_metadata) == (REASONING_PARSERS["qwen3"], False, True)


# --- modes -----------------------------------------------------------------------------------------

def test_no_parsing_when_tool_choice_none_or_auto_off():
    text = hermes_call("search", {"query": "q"})
    none = output_parsing(TOOLS, "none", tool_parser="hermes", auto_tool_choice=True)
    assert none.parse(text).content == text and none.parse(text).tool_calls == []
    off = output_parsing(TOOLS, "auto", tool_parser="hermes", auto_tool_choice=False)
    assert off.parse(text).tool_calls == []


def test_required_output_parsed_as_json_array():
    parsing = output_parsing(TOOLS, "required", tool_parser="hermes", auto_tool_choice=True)
    text = '[{"name": "search", "parameters": {"query": "ä"}}, {"name": "get_weather", "parameters": {"city": "x"}}]'
    parsed = assert_stream_matches(parsing, text)
    assert parsed.content == ""  # vLLM: content or "" when a call is forced
    assert calls_of(parsed) == [("search", {"query": "ä"}), ("get_weather", {"city": "x"})]
    cut = assert_stream_matches(parsing, text[:-20])
    assert calls_of(cut) == [("search", {"query": "ä"})]


def test_named_output_is_the_arguments():
    parsing = output_parsing(TOOLS, {"type": "function", "function": {"name": "search"}},
                             tool_parser="hermes", auto_tool_choice=True)
    parsed = assert_stream_matches(parsing, '{"query": "q"}')
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("search", '{"query": "q"}')]
    assert parsed.content == ""
    assert assert_stream_matches(parsing, '{"query": "q').tool_calls == []


def test_one_shot_delta_has_vllm_shape():
    parsing = auto("hermes")
    stream = parsing.stream()
    delta = merge_deltas(stream.feed("Hi " + hermes_call("search", {"query": "q"})) + stream.finish())
    call_id = stream.tool_calls[0].id
    assert delta == {"content": "Hi ", "tool_calls": [
        {"index": 0, "id": call_id, "type": "function", "function": {"name": "search"}},
        {"index": 0, "function": {"arguments": '{"query": "q"}'}}]}


def test_registered_names_match_vllm():
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_json", "qwen3_coder", "qwen3_xml", "llama3_json", "llama4_json",
                                 "mistral", "deepseek_v3"}
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "deepseek_v3", "step3", "minimax_m2"}


def test_include_reasoning_false_drops_reasoning_and_hides_metadata():
    parsing = auto("hermes", "qwen3", include_reasoning=False)
    text = "<think>secret</think>ok"
    assert (parsing.parse(text).reasoning, parsing.parse(text).content) == (None, "ok")
    stream, events = run_stream(parsing, list(text))
    assert merge_deltas(events) == {"content": "ok"} and stream.finished.reasoning is None
    assert parsing.hides_token_metadata and not auto("hermes", "qwen3").hides_token_metadata
    plain = output_parsing(None, None, tool_parser=None, auto_tool_choice=False, include_reasoning=False)
    assert not plain.hides_token_metadata  # no parser configured: vLLM keeps logprobs and token_ids
