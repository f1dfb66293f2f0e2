"""Translate a validated request into the body of SGLang's native POST /generate.

Only keys SGLang accepts are sent: 0.5.17 answers an unknown sampling key with a
bare 500 and 0.5.23 with a 400, so nothing vLLM-only may leak through.
"""

from __future__ import annotations

from dataclasses import dataclass

from token_proxy.errors import InvalidRequest, max_tokens_too_large, prompt_too_long
from token_proxy.schemas.sampling import SamplingRequest

# vLLM field -> SGLang sampling_params key, copied when the client set it.
_OPTIONAL_SAMPLING = (
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("frequency_penalty", "frequency_penalty"),
    ("presence_penalty", "presence_penalty"),
    ("repetition_penalty", "repetition_penalty"),
    ("seed", "sampling_seed"),
    ("logit_bias", "logit_bias"),
    ("stream_interval", "stream_interval"),
)


@dataclass(frozen=True, slots=True)
class SGLangRequest:
    """One /generate call: its JSON body and the rids to abort it by (SGLang aborts a batch item by item)."""

    body: dict
    rids: list[str]


def sglang_request(prompts: list[list[int]], sampling: SamplingRequest, max_new_tokens: list[int], *, rid: str,
                   stream: bool, cache_salt: str | None = None, priority: int | None = None,
                   lora_path: str | None = None) -> SGLangRequest:
    body = batch_payload(prompts, sampling, max_new_tokens, rid=rid, stream=stream, cache_salt=cache_salt,
                         priority=priority)
    if lora_path is not None:
        body["lora_path"] = lora_path  # one path for every item of a batch
    rids = body["rid"]
    return SGLangRequest(body, rids if isinstance(rids, list) else [rids])


def resolve_max_tokens(sampling: SamplingRequest, prompt_len: int, max_model_len: int,
                       max_prompt_len: int | None = None) -> int:
    """vLLM's rule: absent means the rest of the context, and prompt + max_tokens past the
    context is clamped (finish_reason "length"); only a prompt or a max_tokens that alone
    exceeds the context is the client's error. SGLang refuses prompts past its own
    max_req_input_len (a few tokens under the context): those are refused here, in vLLM's words."""
    if sampling.max_tokens is not None and sampling.max_tokens > max_model_len:
        raise max_tokens_too_large(sampling.max_tokens_param, sampling.max_tokens, max_model_len)
    if prompt_len > (max_prompt_len or max_model_len):
        raise prompt_too_long(max_model_len, prompt_len, max_prompt_len)
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {room}: the prompt ({prompt_len} tokens) "
                             f"fills the model's maximum context length of {max_model_len} tokens.",
                             param="max_tokens")
    return room if sampling.max_tokens is None else min(room, sampling.max_tokens)


def sampling_params(sampling: SamplingRequest, max_new_tokens: int) -> dict:
    params = {
        "max_new_tokens": max_new_tokens,
        "n": sampling.n,
        "skip_special_tokens": sampling.skip_special_tokens,
        "spaces_between_special_tokens": sampling.spaces_between_special_tokens,
    }
    if sampling.min_tokens:
        params["min_new_tokens"] = sampling.min_tokens
    if sampling.stop:
        params["stop"] = list(sampling.stop)
        params["no_stop_trim"] = sampling.include_stop_str_in_output
    if sampling.stop_token_ids and not sampling.ignore_eos:  # under ignore_eos SGLang would ignore them
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        params["ignore_eos"] = True
    for src, dst in _OPTIONAL_SAMPLING:
        value = getattr(sampling, src)
        if value is not None:
            params[dst] = value
    if sampling.constraint is not None:
        key, value = sampling.constraint
        params[key] = value
    return params


def generate_payload(
    prompt_ids: list[int],
    sampling: SamplingRequest,
    max_new_tokens: int,
    *,
    rid: str,
    stream: bool,
    cache_salt: str | None = None,
    priority: int | None = None,
) -> dict:
    params = sampling_params(sampling, max_new_tokens)
    payload = {"input_ids": prompt_ids, "sampling_params": params, "rid": rid, "stream": stream}
    if sampling.n > 1 and sampling.seed is not None:
        payload.update(_seeded_batch(prompt_ids, params, rid, sampling.n, sampling.seed))
    return _with_request_fields(payload, sampling, cache_salt, priority)


def batch_payload(
    prompts: list[list[int]],
    sampling: SamplingRequest,
    max_new_tokens: list[int],
    *,
    rid: str,
    stream: bool,
    cache_salt: str | None = None,
    priority: int | None = None,
) -> dict:
    """Several prompts in one SGLang batch. Choice i*n + j is sample j of prompt i, in SGLang's
    order and in vLLM's (`output.index + prompt_idx * n`)."""
    if len(prompts) == 1:
        return generate_payload(prompts[0], sampling, max_new_tokens[0], rid=rid, stream=stream,
                                cache_salt=cache_salt, priority=priority)
    seeded = sampling.n > 1 and sampling.seed is not None
    input_ids, params, rids = [], [], []
    for p, (ids, max_new) in enumerate(zip(prompts, max_new_tokens)):
        one = sampling_params(sampling, max_new)
        items = _seeded_batch(ids, one, f"{rid}-{p}", sampling.n, sampling.seed) if seeded else {
            "input_ids": [ids], "sampling_params": [one], "rid": [f"{rid}-{p}"]}
        input_ids += items["input_ids"]
        params += items["sampling_params"]
        rids += items["rid"]
    payload = {"input_ids": input_ids, "sampling_params": params, "rid": rids, "stream": stream}
    return _with_request_fields(payload, sampling, cache_salt, priority)


def _with_request_fields(payload: dict, sampling: SamplingRequest, cache_salt: str | None,
                         priority: int | None) -> dict:
    if sampling.logprobs or sampling.prompt_logprobs is not None:
        payload.update(_logprob_fields(sampling))
    if cache_salt is not None:
        # SGLang's native /generate calls it extra_key (its OpenAI layer maps cache_salt onto it);
        # an unknown "cache_salt" key would be dropped silently and the salt lost.
        payload["extra_key"] = cache_salt
    if priority is not None:
        payload["priority"] = priority
    return payload


def _seeded_batch(prompt_ids: list[int], params: dict, rid: str, n: int, seed: int) -> dict:
    """SGLang samples its n copies of a seeded request with the same seed at the same positions,
    so they come out identical; vLLM's n seeded samples differ. Send n one-sample requests with
    seeds seed, seed+1, ... instead (the prefix cache still shares the prompt)."""
    one = dict(params, n=1)
    return {
        "input_ids": [prompt_ids] * n,
        "sampling_params": [dict(one, sampling_seed=(seed + i) % 2**63) for i in range(n)],
        "rid": [f"{rid}-{i}" for i in range(n)],
    }


def _logprob_fields(sampling: SamplingRequest) -> dict:
    top = max(sampling.top_logprobs, _prompt_top(sampling))
    return {
        "return_logprob": True,
        # -1: output logprobs only; 0: also every prompt position (prompt_logprobs).
        "logprob_start_len": -1 if sampling.prompt_logprobs is None else 0,
        "top_logprobs_num": top,
        "return_text_in_logprobs": False,  # the proxy decodes token strings itself
    }


def _prompt_top(sampling: SamplingRequest) -> int:
    if sampling.prompt_logprobs is None or sampling.prompt_logprobs < 0:
        return 0
    return sampling.prompt_logprobs
