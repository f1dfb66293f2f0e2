"""POST /v1/chat/completions/render: vLLM 0.33's answer, a `GenerateRequest` (its
vllm/entrypoints/scale_out/token_in_token_out/protocol.py), built from the chat request the proxy
already parsed and the prompt ids the chat pipeline rendered. Pure: no I/O.

vLLM dumps the whole model (`model_dump()`, None fields included) except `sampling_params`, a
msgspec struct with `omit_defaults=True`: only the fields that differ from SamplingParams'
defaults appear, after its `__post_init__` (stop/stop_token_ids/bad_words become lists, greedy
resets top_p/top_k/min_p, ...). Text-only prompts: `features` is None (the proxy has no
multimodal input; SkyRL reads `features` with `or {}`).
"""

from __future__ import annotations

import orjson

from token_proxy.api.chat.request import ChatRequest
from token_proxy.api.sampling import STRUCTURED_TO_SGLANG
from token_proxy.vocabulary import SamplingRequest

# vLLM's RequestOutputKind: DELTA for a stream, FINAL_ONLY otherwise.
OUTPUT_KIND_DELTA, OUTPUT_KIND_FINAL_ONLY = 1, 2
_SAMPLING_EPS, _MAX_TEMP = 1e-5, 1e-2  # vllm/sampling_params.py
# SGLang's constraint key (the proxy's SamplingRequest.constraint) -> vLLM's StructuredOutputsParams field.
_STRUCTURED_FIELD = {**{sglang: vllm for vllm, sglang in STRUCTURED_TO_SGLANG.items()},
                     "structural_tag": "structural_tag"}
_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                      "disable_additional_properties", "whitespace_pattern", "structural_tag")


def render_response(req: ChatRequest, sampling: SamplingRequest, token_ids: list[int], max_tokens: int,
                    request_id: str, raw: dict, reasoning_kwargs: dict | None) -> dict:
    """vLLM's GenerateRequest for a rendered chat request, keys in its order. `sampling` is the
    request's after the tool constraint (what the pipeline sends); `raw` the body, for the fields
    vLLM echoes as given (None when absent); `reasoning_kwargs` the template kwargs when a
    reasoning parser is on."""
    stream = req.output.stream
    stream_options = None
    if stream and raw.get("stream_options") is not None:
        stream_options = {"include_usage": req.output.include_usage,
                          "continuous_usage_stats": req.output.continuous_usage_stats}
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": vllm_sampling_params(sampling, max_tokens, stream),
        "model": req.model,
        "reasoning_ended": True if not req.include_reasoning else None,
        "reasoning_parser_kwargs": None if reasoning_kwargs is None else {"chat_template_kwargs": reasoning_kwargs},
        "return_token_ids": raw.get("return_token_ids"),
        "output_mode": "tokens",
        "parse_context": parse_context(req),
        "stream": stream,
        "stream_options": stream_options,
        "cache_salt": req.cache_salt,
        "priority": req.priority or 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def vllm_sampling_params(s: SamplingRequest, max_tokens: int, stream: bool) -> dict:
    """ChatCompletionRequest.to_sampling_params, serialized as vLLM does (non-default fields only),
    in SamplingParams' field order."""
    temperature = s.temperature
    if temperature is not None and 0 < temperature < _MAX_TEMP:
        temperature = _MAX_TEMP
    greedy = temperature is not None and temperature < _SAMPLING_EPS
    stop = list(s.stop)
    fields: list[tuple[str, object, object]] = [  # (name, value, vLLM's default)
        ("n", s.n, 1),
        ("presence_penalty", s.presence_penalty, 0.0),
        ("frequency_penalty", s.frequency_penalty, 0.0),
        ("repetition_penalty", s.repetition_penalty, 1.0),
        ("temperature", temperature, 1.0),
        ("top_p", None if greedy else s.top_p, 1.0),
        ("top_k", None if greedy else s.top_k, 0),
        ("min_p", None if greedy else s.min_p, 0.0),
        ("seed", None if s.seed == -1 else s.seed, None),
        ("stop", stop, None),
        ("stop_token_ids", list(dict.fromkeys(s.stop_token_ids)), None),
        ("ignore_eos", s.ignore_eos, False),
        ("max_tokens", max_tokens, 16),
        ("min_tokens", s.min_tokens, 0),
        ("logprobs", s.top_logprobs if s.logprobs else None, None),
        ("prompt_logprobs", s.prompt_logprobs, None),
        ("skip_special_tokens", s.skip_special_tokens, True),
        ("spaces_between_special_tokens", s.spaces_between_special_tokens, True),
        ("include_stop_str_in_output", s.include_stop_str_in_output, False),
        ("output_kind", OUTPUT_KIND_DELTA if stream else OUTPUT_KIND_FINAL_ONLY, 0),
        ("stream_interval", s.stream_interval, None),
        ("skip_clone", True, False),  # to_sampling_params sets it: created fresh per request
        ("output_text_buffer_length",
         max(len(x) for x in stop) - 1 if stop and not s.include_stop_str_in_output else 0, 0),
        ("structured_outputs", structured_outputs(s.constraint), None),
        # vLLM's dict[int, float], as its JSON writes it: the token ids as strings
        ("logit_bias", {str(int(k)): v for k, v in s.logit_bias.items()} if s.logit_bias else None, None),
        ("bad_words", [], None),
        ("skip_reading_prefix_cache", s.prompt_logprobs is not None, None),
    ]
    # An absent field is vLLM's default (the user gave nothing, the server has no generation config).
    return {name: value for name, value, default in fields if value is not None and value != default}


def structured_outputs(constraint: tuple[str, str] | None) -> dict | None:
    if constraint is None:
        return None
    key, value = constraint
    out: dict[str, object] = dict.fromkeys(_STRUCTURED_FIELDS)
    out["disable_any_whitespace"] = out["disable_additional_properties"] = False
    field = _STRUCTURED_FIELD[key]
    out[field] = orjson.loads(value) if field == "json" else value
    return out


def parse_context(req: ChatRequest) -> dict:
    """vLLM's ParseContext: what its /generate needs to parse the output of this request."""
    tools = [_tool(t) for t in req.tools] if req.tools else None
    tool_choice = req.tool_choice
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        tool_choice = {"function": {"name": tool_choice.get("function", {}).get("name")}, "type": "function"}
    history = sum(len(m.get("tool_calls") or ()) for m in req.prompt.messages if m.get("role") == "assistant")
    return {
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "include_reasoning": req.include_reasoning,
        "chat_template_kwargs": dict(req.prompt.chat_template_kwargs or {}),
        "history_tool_call_cnt": history,
    }


def _tool(tool: dict) -> dict:
    """ChatCompletionToolsParam.model_dump(): strict / defer_loading only when given."""
    fn = tool["function"]
    function = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
    for key in ("strict", "defer_loading"):
        if fn.get(key) is not None:
            function[key] = fn[key]
    out = {"type": "function", "function": function}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out
