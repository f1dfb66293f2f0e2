"""Tool calls and reasoning through the proxy's HTTP API with the openai client (issue #12).

Per parser family: a 3-turn tool loop (assistant tool_calls -> tool message -> next turn), streaming
and not, with tool_choice "required" (the simulator honours the json_schema constraint) and with
"auto" (the simulator writes the family's native call text: SimConfig.scripted_output).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.tools.test_tool_loop_render import COMPLETIONS
from token_proxy.simulator import SIM_STATE

TEMPLATES = Path(__file__).parents[1] / "templates"
FAMILIES = ["deepseek_v3", "hermes", "llama3_json", "mistral", "qwen3_coder"]
MODEL = "sim/qwen2-tiny"
EOS = 151645
WEATHER = {"type": "object", "required": ["city", "days"],
           "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ARGS = {"city": "Zürich", "days": 2}  # what COMPLETIONS' calls carry
# ChatML templates end an assistant turn with the simulator's EOS (<|im_end|>), so the model's ids
# are exactly what the next render puts there. The other test templates end it with markers the
# built-in (Qwen2) tokenizer has no tokens for (</s>, <|eom_id|>, <｜end▁of▁sentence｜>), so BPE merges
# across the turn boundary: only the text extends there (the ids do with the family's own tokenizer).
CHATML = {"hermes", "qwen3_coder"}


def client_for(proxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)


async def tool_proxy(make_sim, make_proxy, family: str, scripted: str | None = None, **settings):
    sim = await make_sim(scripted_output=scripted)
    proxy = await make_proxy(sim, tool_call_parser=family, enable_auto_tool_choice=True, **settings)
    return sim, proxy


def call_ids_ok(family: str, choice: str, call_id: str) -> bool:
    if family == "mistral" and choice == "auto":
        return re.fullmatch(r"[A-Za-z0-9]{9}", call_id) is not None
    return re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call_id) is not None


async def whole(client, **kwargs) -> dict:
    r = await client.chat.completions.create(model=MODEL, **kwargs)
    choice = r.choices[0]
    calls = [(c.function.name, c.function.arguments, c.id, c.type) for c in choice.message.tool_calls or []]
    return {"content": choice.message.content, "reasoning": choice.message.model_extra.get("reasoning"),
            "calls": calls, "finish_reason": choice.finish_reason, "token_ids": choice.model_extra["token_ids"],
            "prompt_token_ids": r.model_extra["prompt_token_ids"], "message": choice.message.model_dump()}


async def streamed(client, **kwargs) -> dict:
    stream = await client.chat.completions.create(model=MODEL, stream=True, **kwargs)
    content, reasoning, calls, token_ids, finish, prompt = None, None, {}, [], None, None
    async for chunk in stream:
        prompt = chunk.model_extra.get("prompt_token_ids") or prompt
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            content = (content or "") + delta.content
        if delta.model_extra.get("reasoning"):
            reasoning = (reasoning or "") + delta.model_extra["reasoning"]
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": None, "arguments": "", "id": None, "type": None})
            if call.id:  # the first delta of a call: id, type, name (vLLM's order); a forced call's also arguments
                assert entry["id"] is None
                entry.update(id=call.id, type=call.type, name=call.function.name)
            if call.function and call.function.arguments:
                entry["arguments"] += call.function.arguments
        token_ids += choice.model_extra.get("token_ids") or []
        finish = choice.finish_reason or finish
    ordered = [calls[i] for i in sorted(calls)]
    return {"content": content, "reasoning": reasoning, "finish_reason": finish, "token_ids": token_ids,
            "calls": [(c["name"], c["arguments"], c["id"], c["type"]) for c in ordered], "prompt_token_ids": prompt}


def same_calls(a: dict, b: dict) -> bool:
    """Calls equal up to their random ids."""
    return [c[:2] for c in a["calls"]] == [c[:2] for c in b["calls"]]


def next_messages(reply: dict) -> list[dict]:
    """What an agent loop sends back: the assistant message as received, then one tool result per call."""
    assistant = {"role": "assistant", "content": reply["content"],
                 "tool_calls": [{"id": i, "type": t, "function": {"name": n, "arguments": a}}
                                for n, a, i, t in reply["calls"]]}
    return [assistant, *({"role": "tool", "tool_call_id": i, "content": "sunny, 21 C"} for _, _, i, _ in
                         reply["calls"])]


@pytest.mark.parametrize("family", FAMILIES)
async def test_required_tool_loop_of_three_turns(make_sim, make_proxy, hf_tokenizer, family):
    """"required": the output is vLLM's forced JSON array (json_schema), parsed into tool_calls."""
    _, proxy = await tool_proxy(make_sim, make_proxy, family)
    client = client_for(proxy)
    template = (TEMPLATES / f"{family}.jinja").read_text()
    messages = [{"role": "user", "content": "Weather in Zürich, and the time there?"}]
    previous = None
    for turn in range(3):
        kwargs = {"messages": messages, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
                  "extra_body": {"chat_template": template, "return_token_ids": True}}
        reply = await whole(client, **kwargs)
        stream = await streamed(client, **kwargs)
        assert reply["finish_reason"] == stream["finish_reason"] == "tool_calls"
        assert reply["content"] == ""  # forced: content or "" (vLLM)
        assert reply["calls"] and same_calls(reply, stream), (reply["calls"], stream["calls"])
        for name, arguments, call_id, kind in reply["calls"] + stream["calls"]:
            assert kind == "function" and call_ids_ok(family, "required", call_id)
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        # token_ids are the raw ids: the forced JSON document the model wrote, then EOS
        assert reply["token_ids"] == stream["token_ids"] and reply["token_ids"][-1] == EOS
        document = json.loads(hf_tokenizer.decode(reply["token_ids"][:-1]))
        assert [(d["name"], d["parameters"]) for d in document] == [(n, json.loads(a)) for n, a, _, _ in
                                                                    reply["calls"]]
        if previous is not None:
            prompt, completion = previous
            # The prompt up to the reply is kept; the reply itself is not: the model wrote vLLM's JSON
            # array, which the template renders back in the family's native call format.
            assert hf_tokenizer.decode(reply["prompt_token_ids"]).startswith(hf_tokenizer.decode(prompt))
            if family in CHATML:
                assert reply["prompt_token_ids"][:len(prompt)] == prompt
            assert reply["prompt_token_ids"][:len(prompt) + len(completion)] != prompt + completion
        previous = (reply["prompt_token_ids"], reply["token_ids"])
        messages = messages + next_messages(reply)
    await client.close()


@pytest.mark.parametrize("family", FAMILIES)
async def test_auto_tool_loop_of_three_turns(make_sim, make_proxy, hf_tokenizer, family):
    """"auto": the model writes its native call format; the family's parser turns it into tool_calls, and
    the template renders it back so that the next prompt extends the previous prompt + completion."""
    completion_text, end_of_turn = COMPLETIONS[family]
    sim, proxy = await tool_proxy(make_sim, make_proxy, family, scripted=completion_text)
    client = client_for(proxy)
    template = (TEMPLATES / f"{family}.jinja").read_text()
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    previous = None
    for turn in range(3):
        kwargs = {"messages": messages, "tools": TOOLS, "max_tokens": 200,
                  "extra_body": {"chat_template": template, "return_token_ids": True}}
        reply = await whole(client, **kwargs)
        stream = await streamed(client, **kwargs)
        assert reply["finish_reason"] == stream["finish_reason"] == "tool_calls"
        assert reply["content"] is None and stream["content"] is None  # nothing outside the call
        assert [(n, json.loads(a)) for n, a, _, _ in reply["calls"]] == [("get_weather", ARGS)]
        assert same_calls(reply, stream)
        assert all(k == "function" and call_ids_ok(family, "auto", i) for _, _, i, k in reply["calls"] + stream["calls"])
        assert reply["token_ids"] == stream["token_ids"] == [*hf_tokenizer.encode(completion_text), EOS]
        assert sim.app[SIM_STATE].received[-1]["sampling_params"]["skip_special_tokens"] is False
        if previous is not None:
            prompt, completion = previous
            text = hf_tokenizer.decode(reply["prompt_token_ids"])
            assert text.startswith(hf_tokenizer.decode(prompt) + completion_text + end_of_turn)
            if family in CHATML:  # the model's ids are exactly what the next render starts with
                assert reply["prompt_token_ids"][:len(prompt) + len(completion)] == prompt + completion
        previous = (reply["prompt_token_ids"], reply["token_ids"])
        messages = messages + next_messages(reply)
    await client.close()


async def test_named_function_is_forced_and_finishes_with_stop(make_sim, make_proxy):
    _, proxy = await tool_proxy(make_sim, make_proxy, "hermes")
    client = client_for(proxy)
    kwargs = {"messages": [{"role": "user", "content": "Time in Tokyo?"}], "tools": TOOLS, "max_tokens": 200,
              "tool_choice": {"type": "function", "function": {"name": "get_time"}},
              "extra_body": {"return_token_ids": True}}
    reply, stream = await whole(client, **kwargs), await streamed(client, **kwargs)
    assert reply["finish_reason"] == stream["finish_reason"] == "stop"  # vLLM: a named call ends with "stop"
    assert [c[0] for c in reply["calls"]] == ["get_time"] and same_calls(reply, stream)
    jsonschema.validate(json.loads(reply["calls"][0][1]), SCHEMAS["get_time"])
    await client.close()


async def test_auto_text_around_the_call_and_truncation(make_sim, make_proxy):
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>'
    _, proxy = await tool_proxy(make_sim, make_proxy, "hermes", scripted=text)
    client = client_for(proxy)
    kwargs = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
              "extra_body": {"return_token_ids": True}}
    reply, stream = await whole(client, max_tokens=200, **kwargs), await streamed(client, max_tokens=200, **kwargs)
    assert reply["content"] == stream["content"] == "Let me look.\n"
    assert same_calls(reply, stream) and reply["finish_reason"] == "tool_calls"
    # Cut inside the call by max_tokens: finish "length", no call, and no half call leaked as content.
    cut, cut_stream = await whole(client, max_tokens=8, **kwargs), await streamed(client, max_tokens=8, **kwargs)
    assert cut["finish_reason"] == cut_stream["finish_reason"] == "length"
    assert cut["calls"] == cut_stream["calls"] == []
    assert cut["content"] == cut_stream["content"] == "Let me look.\n"
    assert len(cut["token_ids"]) == 8 and cut["token_ids"] == cut_stream["token_ids"]
    await client.close()


async def test_reasoning_and_tool_call_together(make_sim, make_proxy):
    text = ('<think>\nThe user wants weather; call the tool.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>')
    _, proxy = await tool_proxy(make_sim, make_proxy, "hermes", scripted=text, reasoning_parser="qwen3")
    client = client_for(proxy)
    kwargs = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "max_tokens": 200,
              "extra_body": {"return_token_ids": True}}
    reply, stream = await whole(client, **kwargs), await streamed(client, **kwargs)
    assert reply["content"] is None  # whitespace beside calls is dropped from the message...
    assert stream["content"] == "\n\n"  # ...but was already streamed before the call began (as vLLM)
    for r in (reply, stream):
        assert r["reasoning"] == "\nThe user wants weather; call the tool.\n"
        assert r["finish_reason"] == "tool_calls"
        assert [(n, json.loads(a)) for n, a, _, _ in r["calls"]] == [("get_weather", ARGS)]
    # include_reasoning false: no reasoning, and (vLLM) no token ids that would reveal it
    hidden = await whole(client, **{**kwargs, "extra_body": {"return_token_ids": True, "include_reasoning": False}})
    assert hidden["reasoning"] is None and hidden["token_ids"] is None and hidden["prompt_token_ids"] is None
    assert [c[0] for c in hidden["calls"]] == ["get_weather"]
    # Reasoning without tools: the rest is content
    plain = await whole(client, messages=kwargs["messages"], max_tokens=200)
    assert plain["reasoning"] == "\nThe user wants weather; call the tool.\n"
    assert plain["content"].startswith("\n\n<tool_call>")  # no tools: nothing is parsed as a call
    await client.close()


async def test_plain_requests_stay_unparsed_with_parsers_configured(make_sim, make_proxy):
    """No tools and no reasoning parser: the text is content, byte for byte (no per-chunk parsing)."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    _, proxy = await tool_proxy(make_sim, make_proxy, "hermes", scripted=text)
    client = client_for(proxy)
    kwargs = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
    reply, stream = await whole(client, **kwargs), await streamed(client, **kwargs)
    assert reply["content"] == stream["content"] == text and reply["calls"] == stream["calls"] == []
    assert reply["finish_reason"] == "stop"
    none = await whole(client, tool_choice="none", tools=TOOLS, **kwargs)
    assert none["content"] == text and none["calls"] == []
    await client.close()


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools", None),
    ({"tools": []}, "tools",
     "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely."),
    ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
]


@pytest.mark.parametrize("extra, param, message", BAD)
async def test_bad_tool_input_is_a_400_naming_the_param(make_sim, make_proxy, extra, param, message):
    _, proxy = await tool_proxy(make_sim, make_proxy, "hermes")
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    resp = await proxy.post("/v1/chat/completions", json=body)
    reply = await resp.json()
    assert resp.status == 400 and reply["error"]["param"] == param, reply
    if message:
        assert reply["error"]["message"] == message


async def test_auto_and_forced_choices_need_the_flags(make_sim, make_proxy):
    sim = await make_sim()
    proxy = await make_proxy(sim)  # no --enable-auto-tool-choice (vLLM's default)
    base = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    auto = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    for choice, message in ((None, auto),
                            ("required", 'tool_choice="required" requires --tool-call-parser to be set')):
        body = base if choice is None else {**base, "tool_choice": choice}
        resp = await proxy.post("/v1/chat/completions", json=body)
        reply = await resp.json()
        assert (resp.status, reply["error"]["param"], reply["error"]["message"]) == (400, "tool_choice", message)
    assert sim.app[SIM_STATE].received == []


async def test_exclude_tools_when_tool_choice_none(make_sim, make_proxy, hf_tokenizer):
    sim = await make_sim()
    user = [{"role": "user", "content": "hi"}]
    for exclude, renders_tools in ((False, True), (True, False)):
        proxy = await make_proxy(sim, exclude_tools_when_tool_choice_none=exclude)
        resp = await proxy.post("/v1/chat/completions", json={"messages": user, "tools": TOOLS, "tool_choice": "none",
                                                              "max_tokens": 1, "return_token_ids": True})
        body = await resp.json()
        assert resp.status == 200
        assert ("get_weather" in hf_tokenizer.decode(body["prompt_token_ids"])) is renders_tools


async def test_parser_detected_from_the_chat_template(make_sim, make_proxy, caplog):
    """No --tool-call-parser: the served template (the simulator's ChatML with <tool_call>) names hermes."""
    from token_proxy.state import upstream_of

    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>'
    sim = await make_sim(scripted_output=text)
    with caplog.at_level("INFO", logger="token_proxy.tools.template_detect"):
        proxy = await make_proxy(sim, enable_auto_tool_choice=True)
    assert upstream_of(proxy.server.app).tool_parser == "hermes"
    assert "tool-call parser hermes (detected from the chat template" in caplog.text
    client = client_for(proxy)
    reply = await whole(client, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=100)
    assert [(n, json.loads(a)) for n, a, _, _ in reply["calls"]] == [("get_weather", ARGS)]
    await client.close()


async def test_several_calls_in_one_turn_and_parallel_tool_calls_false(make_sim, make_proxy):
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Zürich", "nested": {"a": [1, "ü"]}}}'
            '\n</tool_call>')
    _, proxy = await tool_proxy(make_sim, make_proxy, "hermes", scripted=text)
    client = client_for(proxy)
    kwargs = {"messages": [{"role": "user", "content": "Weather and time?"}], "tools": TOOLS, "max_tokens": 200}
    reply, stream = await whole(client, **kwargs), await streamed(client, **kwargs)
    expected = [("get_weather", ARGS), ("get_time", {"zone": "Europe/Zürich", "nested": {"a": [1, "ü"]}})]
    assert [(n, json.loads(a)) for n, a, _, _ in reply["calls"]] == expected and same_calls(reply, stream)
    assert len({i for _, _, i, _ in reply["calls"]}) == 2
    single = await whole(client, parallel_tool_calls=False, **kwargs)
    assert [(n, json.loads(a)) for n, a, _, _ in single["calls"]] == expected[:1]
    await client.close()


async def test_forced_calls_with_a_reasoning_parser(make_sim, make_proxy):
    """The json_schema grammar constrains the output from its first token, so a forced call has no
    thinking before it: the whole output is the call, not (unterminated) reasoning."""
    _, proxy = await tool_proxy(make_sim, make_proxy, "hermes", reasoning_parser="qwen3")
    client = client_for(proxy)
    kwargs = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "max_tokens": 200,
              "tool_choice": "required"}
    reply, stream = await whole(client, **kwargs), await streamed(client, **kwargs)
    assert reply["calls"] and same_calls(reply, stream)
    assert reply["reasoning"] is None and stream["reasoning"] is None
    assert reply["finish_reason"] == stream["finish_reason"] == "tool_calls"
    await client.close()


def test_parser_flags_are_checked_at_start_up(capsys):
    from token_proxy.cli import parse_settings

    with pytest.raises(SystemExit):
        parse_settings(["--tool-call-parser", "nope"])
    assert "--tool-call-parser 'nope' is not one of deepseek_v3, hermes," in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(["--reasoning-parser", "r2"])
    assert "--reasoning-parser 'r2' is not one of" in capsys.readouterr().err
    settings = parse_settings(["--enable-auto-tool-choice", "--tool-call-parser", "mistral"])  # vLLM's spelling
    assert (settings.enable_auto_tool_choice, settings.tool_call_parser) == (True, "mistral")


def test_tool_call_streaming_flag(capsys):
    from token_proxy.cli import parse_settings

    assert parse_settings([]).tool_call_streaming == "fragments"  # vLLM's behaviour by default
    assert parse_settings(["--tool-call-streaming", "whole"]).tool_call_streaming == "whole"
    with pytest.raises(SystemExit):
        parse_settings(["--tool-call-streaming", "halves"])
    assert "--tool-call-streaming must be fragments or whole, got 'halves'" in capsys.readouterr().err
    root = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # tests/ may nest
    readme = (root / "README.md").read_text()
    assert "| `--tool-call-streaming` | `fragments` |" in readme



HERMES_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>'


@pytest.mark.parametrize("mode", ["fragments", "whole"])
async def test_cut_call_per_tool_call_streaming_mode(make_sim, make_proxy, mode):
    """A call cut by max_tokens after its name. `whole`: nothing of it is sent. `fragments` (vLLM's
    stream): its header and the fixed head of its arguments were sent, and stay, with finish "length";
    the non-streamed reply has no call either way. A complete call equals the reply in both modes."""
    _, proxy = await tool_proxy(make_sim, make_proxy, "hermes", scripted=HERMES_TEXT, tool_call_streaming=mode)
    client = client_for(proxy)
    kwargs = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    cut, cut_stream = await whole(client, max_tokens=22, **kwargs), await streamed(client, max_tokens=22, **kwargs)
    assert cut["finish_reason"] == cut_stream["finish_reason"] == "length"
    assert cut["content"] == cut_stream["content"] == "Let me look.\n" and cut["calls"] == []
    half = [("get_weather", '{"city": "Zür', "function")] if mode == "fragments" else []
    assert [(n, a, t) for n, a, _, t in cut_stream["calls"]] == half
    # Cut after the arguments' JSON ended but before </tool_call>: a complete call in both.
    done, done_stream = await whole(client, max_tokens=30, **kwargs), await streamed(client, max_tokens=30, **kwargs)
    assert done["finish_reason"] == done_stream["finish_reason"] == "length"
    assert [c[:2] for c in done["calls"]] == [c[:2] for c in done_stream["calls"]] == [
        ("get_weather", '{"city": "Zürich", "days": 2}')]
    await client.close()


async def sse_tool_deltas(proxy, body: dict) -> list[str]:
    """The raw JSON text of every tool_calls delta entry on the wire, in order."""
    import aiohttp
    out = []
    async with (aiohttp.ClientSession() as session,
                session.post(proxy.make_url("/v1/chat/completions"), json={**body, "stream": True}) as resp):
        async for line in resp.content:
            line = line.decode().strip()
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                # json.loads keeps the key order as sent (vLLM's DeltaToolCall: id, type, index, function)
                for entry in choice["delta"].get("tool_calls") or []:
                    out.append(json.dumps(entry, ensure_ascii=False, separators=(",", ":")))
    return out


@pytest.mark.parametrize("mode", ["fragments", "whole"])
async def test_argument_fragments_on_the_wire(make_sim, make_proxy, mode):
    """vLLM streams a call's arguments in pieces as they are generated; `whole` sends them at once."""
    _, proxy = await tool_proxy(make_sim, make_proxy, "hermes", scripted=HERMES_TEXT, tool_call_streaming=mode)
    deltas = await sse_tool_deltas(proxy, {"model": MODEL, "max_tokens": 200, "tools": TOOLS,
                                           "messages": [{"role": "user", "content": "Weather?"}]})
    header = json.loads(deltas[0])
    assert list(header) == ["id", "type", "index", "function"] and header["function"] == {"name": "get_weather"}
    pieces = [json.loads(d)["function"]["arguments"] for d in deltas[1:]]
    assert all(list(json.loads(d)) == ["index", "function"] for d in deltas[1:])
    assert "".join(pieces) == '{"city": "Zürich", "days": 2}'
    if mode == "whole":
        assert pieces == ['{"city": "Zürich", "days": 2}']
    else:  # one token at a time, what became fixed: keys whole, `2` only once the `}}` token ends it
        assert pieces == ['{', '"city": ', '"', 'Z', 'ür', 'ich', '", ', '"days": ', '2}']


@pytest.mark.parametrize("family", ["deepseek_v3", "llama3_json", "mistral"])
async def test_argument_fragments_on_the_wire_per_family(make_sim, make_proxy, family):
    """mistral, deepseek_v3 and llama3_json stream their arguments in pieces too (they were one piece),
    and the pieces join to the non-streamed reply's arguments."""
    completion_text, _ = COMPLETIONS[family]
    _, proxy = await tool_proxy(make_sim, make_proxy, family, scripted=completion_text)
    body = {"model": MODEL, "max_tokens": 200, "tools": TOOLS, "messages": [{"role": "user", "content": "Weather?"}]}
    deltas = [json.loads(d) for d in await sse_tool_deltas(proxy, body)]
    assert list(deltas[0]) == ["id", "type", "index", "function"] and deltas[0]["function"] == {"name": "get_weather"}
    pieces = [d["function"]["arguments"] for d in deltas[1:]]
    client = client_for(proxy)
    reply = await whole(client, messages=body["messages"], tools=TOOLS, max_tokens=200)
    assert len(pieces) > 3 and "".join(pieces) == reply["calls"][0][1]
    assert json.loads(reply["calls"][0][1]) == ARGS
    await client.close()


async def test_forced_calls_stream_fragments_with_the_name_first(make_sim, make_proxy):
    """vLLM's serving layer: a forced call's first delta carries id, type, index and function {name,
    arguments so far}; then argument pieces, which join to the non-streamed reply's arguments."""
    _, proxy = await tool_proxy(make_sim, make_proxy, "hermes")
    client = client_for(proxy)
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        body = {"model": MODEL, "max_tokens": 200, "tools": TOOLS, "tool_choice": choice,
                "messages": [{"role": "user", "content": "Time in Tokyo?"}]}
        deltas = [json.loads(d) for d in await sse_tool_deltas(proxy, body)]
        headers = [d for d in deltas if "id" in d]
        assert all(list(h) == ["id", "type", "index", "function"] and list(h["function"]) == ["name", "arguments"]
                   for h in headers)
        reply = await whole(client, messages=body["messages"], tools=TOOLS, tool_choice=choice, max_tokens=200)
        joined = ["".join(d["function"]["arguments"] for d in deltas if d["index"] == i) for i in range(len(headers))]
        assert joined == [c[1] for c in reply["calls"]] and len(deltas) > len(headers)
    await client.close()
