"""The simulator honours SGLang's json_schema constraint: the output validates against the schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from token_proxy.simulator.constrained import forced_output_ids
from token_proxy.simulator.testing import stream_events
from token_proxy.tools import constraint_for, output_parsing

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city", "days"],
        "properties": {"city": {"type": "string", "minLength": 5}, "days": {"type": "integer", "minimum": 3},
                       "unit": {"enum": ["c", "f"]}, "when": {"anyOf": [{"type": "null"}, {"type": "string"}]},
                       "spots": {"type": "array", "items": {"$ref": "#/$defs/Spot"}, "minItems": 2}},
        "$defs": {"Spot": {"type": "object", "properties": {"lat": {"type": "number"}, "ok": {"type": "boolean"}}}},
    }}},
    {"type": "function", "function": {"name": "now"}},
]


@pytest.fixture
async def sim(make_sim):
    return await make_sim()


async def generate(sim, aiohttp_client, sampling_params, prompt="Call a tool.", stream=False):
    client = await aiohttp_client(sim)
    body = {"text": prompt, "sampling_params": {"temperature": 0, **sampling_params}, "stream": stream}
    response = await client.post("/generate", json=body)
    assert response.status == 200
    return stream_events(await response.read()) if stream else await response.json()


@pytest.mark.parametrize("prompt", ["Call a tool.", "Another prompt, another branch", "x"])
async def test_required_output_is_a_schema_valid_call(sim, aiohttp_client, prompt):
    constraint = constraint_for(TOOLS, "required")
    reply = await generate(sim, aiohttp_client, {**constraint, "max_new_tokens": 200}, prompt)
    document = json.loads(reply["text"])
    jsonschema.validate(document, json.loads(constraint["json_schema"]))
    assert reply["meta_info"]["finish_reason"]["type"] == "stop"
    parsing = output_parsing(TOOLS, "required", tool_parser="hermes", auto_tool_choice=True)
    parsed = parsing.parse(reply["text"])
    assert [c.name for c in parsed.tool_calls] == [item["name"] for item in document]


async def test_named_output_is_the_arguments(sim, aiohttp_client):
    constraint = constraint_for(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    reply = await generate(sim, aiohttp_client, {**constraint, "max_new_tokens": 200})
    jsonschema.validate(json.loads(reply["text"]), TOOLS[0]["function"]["parameters"])
    assert reply["meta_info"]["finish_reason"]["type"] == "stop"
    parsing = output_parsing(TOOLS, {"type": "function", "function": {"name": "get_weather"}},
                             tool_parser="hermes", auto_tool_choice=True)
    assert [(c.name, json.loads(c.arguments)) for c in parsing.parse(reply["text"]).tool_calls] == [
        ("get_weather", json.loads(reply["text"]))]


async def test_streamed_output_is_the_same_document(sim, aiohttp_client):
    constraint = constraint_for(TOOLS, "required")
    whole = await generate(sim, aiohttp_client, {**constraint, "max_new_tokens": 200})
    events = await generate(sim, aiohttp_client, {**constraint, "max_new_tokens": 200}, stream=True)
    last = events[-1]  # cumulative stream (the simulator's default, as SGLang's)
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["finish_reason"]["type"] == "stop"


async def test_cut_short_by_max_new_tokens(sim, aiohttp_client):
    constraint = constraint_for(TOOLS, "required")
    reply = await generate(sim, aiohttp_client, {**constraint, "max_new_tokens": 5})
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert len(reply["output_ids"]) == 5
    parsing = output_parsing(TOOLS, "required", tool_parser="hermes", auto_tool_choice=True)
    assert parsing.parse(reply["text"]).tool_calls == []  # no half call


async def test_invalid_schema_aborts_as_sglang_does(sim, aiohttp_client):
    client = await aiohttp_client(sim)
    response = await client.post("/generate", json={"text": "x", "sampling_params": {"json_schema": "{nope"}})
    body = await response.json()
    assert response.status == 400, body
    assert body["error"]["message"].startswith("Failed to compile json grammar: "), body


def test_forced_ids_decode_to_the_document(tokenizer_dir):
    from token_proxy.simulator.vocab import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir))
    schema = {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "number"}}}
    ids = forced_output_ids(json.dumps(schema), [1, 2, 3], lambda text: tokenizer.encode(text).ids)
    assert json.loads(tokenizer.decode(list(ids))) == {"q": "sim", "n": 1}


# --- regex and ebnf (issue 31: they reached the simulator and were silently ignored) -----------------

GRAMMAR = 'root ::= answer " " num\nanswer ::= "yes" | "no"\nnum ::= [1-9] [0-9]* ("." [0-9]+)?\n'


@pytest.mark.parametrize("prompt", ["Call a tool.", "Another prompt, another branch", "x"])
@pytest.mark.parametrize(("key", "value", "accepts"), [
    ("regex", r"(yes|no|maybe)", lambda text: text in ("yes", "no", "maybe")),
    ("regex", r"\d{3}-[a-z]+@\w+\.com", lambda text: __import__("re").fullmatch(r"\d{3}-[a-z]+@\w+\.com", text)),
    ("ebnf", GRAMMAR, lambda text: __import__("re").fullmatch(r"(yes|no) [1-9][0-9]*(\.[0-9]+)?", text)),
])
async def test_regex_and_ebnf_outputs_are_accepted_texts(sim, aiohttp_client, prompt, key, value, accepts):
    reply = await generate(sim, aiohttp_client, {key: value, "max_new_tokens": 50}, prompt)
    assert accepts(reply["text"]), reply["text"]
    assert reply["meta_info"]["finish_reason"]["type"] == "stop"


async def test_choices_follow_the_prompt(sim, aiohttp_client):
    texts = {(await generate(sim, aiohttp_client, {"regex": "(red|green|blue)"}, prompt))["text"]
             for prompt in ("a", "bb", "ccc", "dddd", "eeeee", "ffffff")}
    assert len(texts) > 1 and texts <= {"red", "green", "blue"}


@pytest.mark.parametrize(("key", "value", "start"), [
    ("regex", "(unclosed", "Failed to compile regex grammar: "),
    ("ebnf", "answer ::= \"x\"", "Failed to compile ebnf grammar: "),
])
async def test_a_constraint_that_does_not_compile_aborts_as_sglang_does(sim, aiohttp_client, key, value, start):
    client = await aiohttp_client(sim)
    response = await client.post("/generate", json={"text": "x", "sampling_params": {key: value}})
    body = await response.json()
    assert response.status == 400, body
    assert body["error"]["message"].startswith(start), body


@pytest.mark.parametrize(("structured", "accepts"), [
    ({"choice": ["positive", "negative"]}, lambda text: text in ("positive", "negative")),
    ({"regex": r"[A-Z]{2}\d"}, lambda text: __import__("re").fullmatch(r"[A-Z]{2}\d", text)),
    ({"grammar": GRAMMAR}, lambda text: __import__("re").fullmatch(r"(yes|no) [1-9][0-9]*(\.[0-9]+)?", text)),
])
async def test_vllm_structured_outputs_through_the_proxy(sim, make_proxy, structured, accepts):
    proxy = await make_proxy(sim)
    response = await proxy.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Classify."}], "max_tokens": 30,
        "structured_outputs": structured})
    body = await response.json()
    assert response.status == 200, body
    assert accepts(body["choices"][0]["message"]["content"]), body
    assert body["choices"][0]["finish_reason"] == "stop"


CHOICES = ["red", "green", "blue", "amber", "violet", "cyan"]
CONSTRAINED = [
    pytest.param({"structured_outputs": {"choice": CHOICES}}, id="choice"),
    pytest.param({"structured_outputs": {"regex": "(north|south|east|west|up|down)"}}, id="regex"),
    pytest.param({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                 id="forced-tool-call"),
    pytest.param({"tools": TOOLS, "tool_choice": "required"}, id="required-tool-call"),
]


def answers(body: dict) -> list[str]:
    return [json.dumps([c["function"] for c in choice["message"].get("tool_calls") or []])
            + (choice["message"]["content"] or "") for choice in body["choices"]]


@pytest.mark.parametrize("constrained", CONSTRAINED)
async def test_n_samples_under_a_constraint_differ_and_one_seed_gives_one_answer(sim, make_proxy, constrained):
    """issue 39: n=4 under regex, choice or a forced tool call gave four identical answers, so a GRPO group under
    structured outputs had zero variance on the simulator. Sampled, they differ where the constraint leaves a
    choice; a seed gives the same four again; greedy is one answer four times, as a greedy decode."""
    proxy = await make_proxy(sim, tool_call_parser="hermes", enable_auto_tool_choice=True)

    async def chat(**extra) -> list[str]:
        response = await proxy.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 300, "n": 4, **constrained, **extra})
        body = await response.json()
        assert response.status == 200, body
        assert {c["finish_reason"] for c in body["choices"]} <= {"stop", "tool_calls"}, body
        return answers(body)

    seeded = await chat(temperature=1.0, seed=7)
    assert len(set(seeded)) > 1, seeded
    assert await chat(temperature=1.0, seed=7) == seeded
    assert await chat(temperature=1.0, seed=8) != seeded
    assert len(set(await chat(temperature=1.0))) > 1
    greedy = await chat(temperature=0)
    assert len(set(greedy)) == 1, greedy
