"""The fixed requests whose answers must not change by a byte: every client-facing endpoint the proxy serves
(token_proxy/routes.py's data plane and probes), the features a trainer reads (ids, logprobs, tool calls,
sessions, streams) and the error answers of a few bad inputs.

A case is one or more steps sent in order on one proxy; a step is a Request, or a function of the answers
so far that builds one (a session's second turn carries the first turn's reply). Sampled requests carry a
seed (the simulator runs with deterministic inference); the others use temperature 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

MODEL = "sim/qwen2-tiny"
USER = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT_IDS = [785, 3974, 13876, 38835]  # "The quick brown fox"
# USER as the template renders it: the prompt of the golden SGLang recordings.
GOLDEN_PROMPT_IDS = [151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198]
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
WEATHER = {"type": "function", "function": {"name": "get_weather"}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "capital", "schema": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}



@dataclass(frozen=True)
class Setup:
    """One simulator + proxy pair: SimConfig and Settings overrides; `golden`: /generate answered from the
    golden SGLang 0.5.17 recordings (golden_replay.py), which streamed cumulatively."""

    sim: dict = field(default_factory=dict)
    proxy: dict = field(default_factory=dict)
    golden: bool = False


# "default": the proxy with default settings in front of SGLang started as the README says
# (--incremental-streaming-output); "cumulative": SGLang's default streaming (every event repeats the whole
# output); "hermes": tool calls parsed, in front of a simulator that answers every unconstrained request with
# one; "golden": real SGLang's recorded replies.
INCREMENTAL = {"incremental_streaming_output": True}
SETUPS: dict[str, Setup] = {
    "default": Setup(INCREMENTAL),
    "cumulative": Setup({"incremental_streaming_output": False}),
    "hermes": Setup({**INCREMENTAL, "scripted_output": TOOL_CALL},
                    {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}),
    "golden": Setup({"incremental_streaming_output": False}, golden=True),
}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    json: object = None
    raw: bytes | None = None  # sent as is (bad JSON)
    headers: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)


Step = Request | Callable[[list[dict]], Request]


@dataclass(frozen=True)
class Case:
    name: str
    steps: tuple[Step, ...]
    setup: str = "default"


def post(path: str, body, **kwargs) -> Request:
    return Request("POST", path, json=body, **kwargs)


def chat(**body) -> tuple[Request]:
    return (post("/v1/chat/completions", {"model": MODEL, "messages": USER, **body}),)


def completions(**body) -> tuple[Request]:
    return (post("/v1/completions", {"model": MODEL, **body}),)


def generate(**body) -> tuple[Request]:
    return (post("/inference/v1/generate", {"model": MODEL, "token_ids": PROMPT_IDS, **body}),)


def _second_turn(answers: list[dict]) -> Request:
    """The session's second turn: the first turn's assistant message, then a new user message."""
    reply = orjson.loads(answers[0]["body"])["choices"][0]["message"]
    assistant = {"role": "assistant", "content": reply["content"]}
    return post("/v1/chat/completions", {"model": MODEL, "messages": [*USER, assistant, {
        "role": "user", "content": "And of Spain?"}], "max_tokens": 6, "temperature": 0, "return_token_ids": True},
        headers={"X-Session-ID": "golden-session"})


GREEDY = {"temperature": 0}
CHAT_IDS = {"return_token_ids": True, **GREEDY}

CASES: tuple[Case, ...] = (
    # --- /v1/chat/completions ---
    Case("chat/plain", chat(max_tokens=8, **GREEDY)),
    Case("chat/return_token_ids", chat(max_tokens=8, **CHAT_IDS)),
    Case("chat/logprobs_top2", chat(max_tokens=4, logprobs=True, top_logprobs=2, **CHAT_IDS)),
    Case("chat/n2_seeded", chat(max_tokens=5, n=2, seed=7, temperature=1.0, return_token_ids=True)),
    Case("chat/stop_string", chat(max_tokens=16, stop=["a"], **CHAT_IDS)),
    Case("chat/stop_token_ids", chat(max_tokens=16, stop_token_ids=[11], **CHAT_IDS)),
    Case("chat/max_tokens_absent", chat(**GREEDY, seed=3)),
    Case("chat/response_format_json_schema", chat(max_tokens=40, response_format=JSON_SCHEMA, **CHAT_IDS)),
    Case("chat/tools_choice_none", chat(max_tokens=4, tools=TOOLS, tool_choice="none", **CHAT_IDS)),
    Case("chat/system_and_multiturn", (post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."}, *USER, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Sûr ? 日本語 🙂"}], "max_tokens": 6, **CHAT_IDS}),)),
    Case("chat/continue_final_message", (post("/v1/chat/completions", {"model": MODEL, "messages": [
        *USER, {"role": "assistant", "content": "The capital is"}], "add_generation_prompt": False,
        "continue_final_message": True, "max_tokens": 4, **CHAT_IDS}),)),
    Case("chat/stream", chat(max_tokens=6, stream=True, **GREEDY)),
    Case("chat/stream_include_usage_ids", chat(max_tokens=6, stream=True, stream_options={"include_usage": True},
                                               **CHAT_IDS)),
    Case("chat/stream_continuous_usage", chat(max_tokens=4, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, **GREEDY)),
    Case("chat/stream_logprobs", chat(max_tokens=4, stream=True, logprobs=True, top_logprobs=2, **GREEDY)),
    Case("chat/stream_n2_seeded", chat(max_tokens=4, stream=True, n=2, seed=11, temperature=1.0,
                                       return_token_ids=True)),
    Case("chat/stream_stop_string", chat(max_tokens=16, stream=True, stop=["a"], **CHAT_IDS)),
    Case("chat/client_request_id", chat(max_tokens=3, **GREEDY, request_id="golden-rid-1")),
    Case("chat/header_request_id", (post("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 3,
                                                                 **GREEDY}, headers={"X-Request-Id": "golden-x"}),)),
    Case("chat/session_continuation", (
        post("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 6, **CHAT_IDS},
             headers={"X-Session-ID": "golden-session"}),
        _second_turn,
        Request("POST", "/finish_session", params={"session_id": "golden-session"}),
    )),
    Case("chat/tokens", (post("/v1/chat/completions/tokens", {"model": MODEL, "messages": USER,
                                                             "tokens": PROMPT_IDS, "max_tokens": 4, **GREEDY}),)),
    # --- tool calls (hermes parser; the simulator writes TOOL_CALL unless constrained) ---
    Case("tools/auto", chat(max_tokens=64, tools=TOOLS, tool_choice="auto", **CHAT_IDS), "hermes"),
    Case("tools/auto_stream", chat(max_tokens=64, tools=TOOLS, tool_choice="auto", stream=True, **CHAT_IDS),
         "hermes"),
    Case("tools/required", chat(max_tokens=64, tools=TOOLS, tool_choice="required", **CHAT_IDS), "hermes"),
    Case("tools/named", chat(max_tokens=64, tools=TOOLS, tool_choice=WEATHER, **CHAT_IDS), "hermes"),
    Case("tools/named_stream", chat(max_tokens=64, tools=TOOLS, tool_choice=WEATHER, stream=True, **CHAT_IDS),
         "hermes"),
    Case("tools/render", (post("/v1/chat/completions/render", {"model": MODEL, "messages": USER, "tools": TOOLS}),),
         "hermes"),
    Case("tools/derender", (post("/v1/chat/completions/derender", {
        "generate_response": {"choices": [{"index": 0, "token_ids": [151657, 198, 4913, 606, 788, 330, 455, 69364,
                                                                     497, 330, 16370, 788, 5212, 8926, 788, 330,
                                                                     59604, 9207, 532, 151658, 151645],
                                           "finish_reason": "stop"}]},
        "chat_request": {"messages": USER, "tools": TOOLS}}),), "hermes"),
    Case("chat/stream_cumulative", chat(max_tokens=6, stream=True, stream_options={"include_usage": True},
                                        **CHAT_IDS), "cumulative"),
    Case("chat/stream_n2_cumulative", chat(max_tokens=4, stream=True, n=2, seed=11, temperature=1.0,
                                           logprobs=True, return_token_ids=True), "cumulative"),
    # --- real SGLang 0.5.17 replies (the golden recordings) behind the proxy ---
    Case("golden/chat_greedy", chat(max_tokens=8, **CHAT_IDS), "golden"),
    Case("golden/chat_logprobs_top2", chat(max_tokens=8, logprobs=True, top_logprobs=2, **CHAT_IDS), "golden"),
    Case("golden/chat_stop_on_eos", chat(max_tokens=32, min_tokens=4, logit_bias={"151645": 100}, **CHAT_IDS),
         "golden"),
    Case("golden/chat_stop_string", chat(max_tokens=8, stop=["\n\n"], **CHAT_IDS), "golden"),
    Case("golden/chat_stream", chat(max_tokens=8, stream=True, stream_options={"include_usage": True}, **CHAT_IDS),
         "golden"),
    Case("golden/chat_stream_logprobs_top2", chat(max_tokens=4, stream=True, logprobs=True, top_logprobs=2,
                                                  **CHAT_IDS), "golden"),
    Case("golden/chat_stream_stop_on_eos", chat(max_tokens=32, min_tokens=4, logit_bias={"151645": 100},
                                                stream=True, **CHAT_IDS), "golden"),
    Case("golden/completions_ids", (post("/v1/completions", {"model": MODEL, "prompt": GOLDEN_PROMPT_IDS,
                                                             "max_tokens": 16, **CHAT_IDS}),), "golden"),
    Case("golden/generate", (post("/inference/v1/generate", {"model": MODEL, "token_ids": GOLDEN_PROMPT_IDS,
                                                             "sampling_params": {"max_tokens": 8, "temperature": 0,
                                                                                 "stop_token_ids": [198]}}),),
         "golden"),
    Case("golden/generate_stream", (post("/inference/v1/generate", {"model": MODEL, "token_ids": GOLDEN_PROMPT_IDS,
                                                                    "stream": True, "sampling_params": {
                                                                        "max_tokens": 8, "temperature": 0}}),),
         "golden"),
    # --- /v1/completions ---
    Case("completions/text", completions(prompt="The quick brown fox", max_tokens=6, **GREEDY)),
    Case("completions/token_ids", completions(prompt=PROMPT_IDS, max_tokens=6, return_token_ids=True, **GREEDY)),
    Case("completions/batch", completions(prompt=["The quick", "brown fox"], max_tokens=3, **GREEDY)),
    Case("completions/echo_logprobs", completions(prompt="The quick brown fox", max_tokens=3, echo=True, logprobs=2,
                                                  **GREEDY)),
    Case("completions/n2_seeded", completions(prompt=PROMPT_IDS, max_tokens=4, n=2, seed=5, temperature=1.0)),
    Case("completions/stream", completions(prompt="The quick brown fox", max_tokens=5, stream=True, **GREEDY)),
    Case("completions/stream_logprobs_usage", completions(prompt=PROMPT_IDS, max_tokens=4, stream=True, logprobs=1,
                                                          stream_options={"include_usage": True},
                                                          return_token_ids=True, **GREEDY)),
    Case("completions/stream_cumulative", completions(prompt="The quick brown fox", max_tokens=5, stream=True,
                                                      logprobs=1, **GREEDY), "cumulative"),
    # --- /inference/v1/generate (token in) ---
    Case("generate/plain", generate(sampling_params={"max_tokens": 6, "temperature": 0})),
    Case("generate/logprobs", generate(sampling_params={"max_tokens": 4, "temperature": 0, "logprobs": 2})),
    Case("generate/seeded", generate(sampling_params={"max_tokens": 5, "temperature": 1.0, "seed": 3})),
    Case("generate/stream", generate(stream=True, sampling_params={"max_tokens": 5, "temperature": 0})),
    Case("generate/stream_logprobs", generate(stream=True, sampling_params={"max_tokens": 4, "temperature": 0,
                                                                            "logprobs": 1})),
    Case("generate/stream_cumulative", generate(stream=True, sampling_params={"max_tokens": 5, "temperature": 0}),
         "cumulative"),
    # --- render / derender (no SGLang) ---
    Case("render/plain", (post("/v1/chat/completions/render", {"model": MODEL, "messages": USER}),)),
    Case("derender/plain", (post("/v1/chat/completions/derender", {
        "generate_response": {"request_id": "r-1", "choices": [{"index": 0, "token_ids": [785, 3974, 151645],
                                                                "finish_reason": "stop"}]},
        "prompt_token_ids": [151644, 872, 198, 3838, 151645, 198, 151644, 77091, 198],
        "chat_request": {"messages": USER, "return_token_ids": True}}),)),
    # --- tokenizer endpoints ---
    Case("tokenize/prompt", (post("/tokenize", {"prompt": "The quick brown fox"}),)),
    Case("tokenize/v1_messages_token_strs", (post("/v1/tokenize", {"model": MODEL, "messages": USER,
                                                                   "return_token_strs": True}),)),
    Case("detokenize/plain", (post("/detokenize", {"tokens": PROMPT_IDS}),)),
    Case("detokenize/v1", (post("/v1/detokenize", {"model": MODEL, "tokens": [*PROMPT_IDS, 151645]}),)),
    # --- probes ---
    Case("models", (Request("GET", "/v1/models"),)),
    Case("version", (Request("GET", "/version"),)),
    Case("health", (Request("GET", "/health"),)),
    Case("openapi", (Request("GET", "/openapi.json"),)),
    Case("fetch_weights", (Request("GET", "/fetch_weights"),)),
    # --- error answers ---
    Case("error/invalid_json", (Request("POST", "/v1/chat/completions", raw=b'{"messages": [}'),)),
    Case("error/messages_missing", (post("/v1/chat/completions", {"model": MODEL}),)),
    Case("error/max_tokens_negative", chat(max_tokens=-1)),
    Case("error/temperature_type", chat(temperature="hot")),
    Case("error/unknown_model", chat(model="no-such-model", max_tokens=1)),
    Case("error/context_overflow", chat(max_tokens=100000)),
    Case("error/tools_auto_without_parser", chat(max_tokens=1, tools=TOOLS)),
    Case("error/logprobs_top_too_many", chat(max_tokens=1, logprobs=True, top_logprobs=99)),
    Case("error/method_not_allowed", (Request("GET", "/v1/chat/completions"),)),
    Case("error/completions_no_prompt", completions(max_tokens=1)),
    Case("error/generate_float_token_id", (post("/inference/v1/generate", {"token_ids": [1.5]}),)),
    Case("error/generate_bad_sampling", generate(sampling_params={"temperature": "hot"})),
    Case("error/derender_stream", (post("/v1/chat/completions/derender", {
        "generate_response": {"choices": [{"index": 0, "token_ids": [785], "finish_reason": "stop"}]},
        "chat_request": {"messages": USER}, "stream": True}),)),
    Case("error/generate_stream_with_n", generate(stream=True, sampling_params={"max_tokens": 2, "n": 0})),
    Case("error/detokenize_out_of_vocab", (post("/detokenize", {"tokens": [10**7]}),)),
    Case("error/tokenize_bad_prompt", (post("/tokenize", {"prompt": 5}),)),
)
