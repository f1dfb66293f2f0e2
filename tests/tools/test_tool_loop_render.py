"""A tool loop through the chat template: the parsed call, sent back as OpenAI clients send it,
renders so that the next prompt starts with the previous prompt + the completion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from token_proxy.tools import messages_for_template, output_parsing

TEMPLATES = Path(__file__).parents[1] / "templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
ARGS = {"city": "Zürich", "days": 2}
A = json.dumps(ARGS, ensure_ascii=False)
# What each family's model writes for one call, and the token that ends its turn.
COMPLETIONS = {
    "hermes": (f'<tool_call>\n{{"name": "get_weather", "arguments": {A}}}\n</tool_call>', "<|im_end|>"),
    "qwen3_coder": (("<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
                     "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"), "<|im_end|>"),
    "llama3_json": (f'<|python_tag|>{{"name": "get_weather", "parameters": {A}}}', "<|eom_id|>"),
    "mistral": (f"[TOOL_CALLS]get_weather[ARGS]{A}", "</s>"),
    "deepseek_v3": (("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                     f"{A}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), "<｜end▁of▁sentence｜>"),
}


def render(hf_tokenizer, template: str, messages: list[dict]) -> str:
    return hf_tokenizer.apply_chat_template(
        messages_for_template(messages), tools=TOOLS, chat_template=template,
        add_generation_prompt=True, tokenize=False)


def next_turn(parser: str, completion: str) -> list[dict]:
    parsed = output_parsing(TOOLS, "auto", tool_parser=parser, auto_tool_choice=True).parse(completion)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", ARGS)]
    # what the openai client sends back: the message as received, arguments a JSON string
    assistant = {"role": "assistant", "content": parsed.content,
                 "tool_calls": [call.to_openai() for call in parsed.tool_calls]}
    tool = {"role": "tool", "tool_call_id": parsed.tool_calls[0].id, "content": "sunny"}
    return [assistant, tool]


@pytest.mark.parametrize("parser", sorted(COMPLETIONS))
def test_next_prompt_extends_prompt_plus_completion(hf_tokenizer, parser):
    template = (TEMPLATES / f"{parser}.jinja").read_text()
    first = [{"role": "user", "content": "Weather in Zürich?"}]
    completion, end_of_turn = COMPLETIONS[parser]
    prompt1 = render(hf_tokenizer, template, first)
    prompt2 = render(hf_tokenizer, template, first + next_turn(parser, completion))
    assert prompt2.startswith(prompt1 + completion + end_of_turn)


def test_hermes_ids_extend_across_turns(hf_tokenizer):
    """With the built-in tokenizer (<tool_call> is one token), ids extend too, not only text."""
    template = (TEMPLATES / "hermes.jinja").read_text()
    first = [{"role": "user", "content": "Weather in Zürich?"}]
    completion, end_of_turn = COMPLETIONS["hermes"]
    ids1 = hf_tokenizer.encode(render(hf_tokenizer, template, first), add_special_tokens=False)
    completion_ids = hf_tokenizer.encode(completion + end_of_turn, add_special_tokens=False)
    ids2 = hf_tokenizer.encode(render(hf_tokenizer, template, first + next_turn("hermes", completion)),
                               add_special_tokens=False)
    assert ids2[: len(ids1) + len(completion_ids)] == ids1 + completion_ids


def test_bad_history_arguments_become_an_empty_object():
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{not json"}},
        {"id": "y", "type": "function", "function": {"name": "g", "arguments": "[1]"}},
        {"id": "z", "type": "function", "function": {"name": "h", "arguments": '{"a": 1}'}}]},
        {"role": "assistant", "content": "hi", "tool_calls": []}]
    out = messages_for_template(messages)
    assert [c["function"]["arguments"] for c in out[0]["tool_calls"]] == [{}, {}, {"a": 1}]
    assert "tool_calls" not in out[1]
    assert messages[0]["tool_calls"][2]["function"]["arguments"] == '{"a": 1}'  # input untouched
