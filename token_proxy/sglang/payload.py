"""Translate a validated request into the body of SGLang's native POST /generate.

Only keys SGLang accepts are sent: 0.5.17 answers an unknown sampling key with a
bare 500 and 0.5.22+ with a 400, so nothing vLLM-only may leak through (every key here is
in every generation's list: sglang_api.SAMPLING_KEYS_0517).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from token_proxy.errors import InvalidRequest, max_tokens_too_large, prompt_too_long
from token_proxy.sglang.retry_rules import VersionCheck
from token_proxy.sglang.versions import VERIFIED_FEATURES, SGLangFeatures
from token_proxy.vocabulary import Reloads, SamplingRequest

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
    """One /generate call: its JSON body, the rids to abort it by (SGLang aborts a batch item by item), and
    the routing key a router that routes by key reads (a session's id: routing_headers). What the retry
    point may do rides along (sglang/retry_rules.py): `reload` re-loads a lost LoRA adapter (an adapter
    request's), `check` judges a reply's weight version (the fleet's stale-weights check)."""

    body: dict
    rids: list[str]
    routing_key: str | None = None
    reload: Reloads | None = None
    check: VersionCheck | None = None

    @property
    def headers(self) -> dict[str, str]:
        return routing_headers(self.routing_key)


# sglang-router's and SMG's `consistent_hashing` (and `manual`) policies route by this header: every turn of a
# session (X-Session-ID) reaches the worker that holds its prefix cache. Other servers ignore it.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


def routing_headers(key: str | None) -> dict[str, str]:
    return {ROUTING_KEY_HEADER: key} if key and key.isascii() else {}


def sglang_request(prompts: list[list[int]], sampling: SamplingRequest, max_new_tokens: list[int], *, rid: str,
                   stream: bool, cache_salt: str | None = None, priority: int | None = None,
                   lora_path: str | None = None, api: SGLangFeatures = VERIFIED_FEATURES,
                   routing_key: str | None = None, reload: Reloads | None = None,
                   check: VersionCheck | None = None) -> SGLangRequest:
    body = batch_payload(prompts, sampling, max_new_tokens, rid=rid, stream=stream, cache_salt=cache_salt,
                         priority=priority, api=api)
    if lora_path is not None:
        body["lora_path"] = lora_path  # one path for every item of a batch
    rids = body["rid"]
    return SGLangRequest(body, rids if isinstance(rids, list) else [rids], routing_key, reload, check)


CONSTRAINT_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


def with_sampling_overrides(sampling: SamplingRequest, params: dict) -> SamplingRequest:
    """Fold SGLang sampling_params that a request's tools imply (tools.constraint_for: a forced-call
    constraint; tools.sampling_overrides: skip_special_tokens) into the request, so the payload and the
    proxy's own decoding agree. A forced-call constraint replaces a response_format one, as in vLLM."""
    changes: dict = {}
    for key, value in params.items():
        if key in CONSTRAINT_KEYS:
            changes["constraint"] = (key, value)
        elif key == "skip_special_tokens":
            changes["skip_special_tokens"] = value
        else:
            raise ValueError(f"no SamplingRequest field for SGLang's {key!r}")
    return dataclasses.replace(sampling, **changes) if changes else sampling


def resolve_max_tokens(sampling: SamplingRequest, prompt_len: int, max_model_len: int,
                       max_prompt_len: int | None = None) -> int:
    """vLLM's rule: absent means the rest of the context, and prompt + max_tokens past the
    context is clamped (finish_reason "length"); only a prompt or a max_tokens that alone
    exceeds the context is the client's error. SGLang refuses prompts past its own
    max_req_input_len (a few tokens under the context): those are refused here, in vLLM's words."""
    if prompt_len == 0:  # vLLM's processor refuses it in these words; SGLang would answer "input_ids cannot be empty"
        raise InvalidRequest("The decoder prompt cannot be empty", param="input_tokens")
    if sampling.max_tokens is not None and sampling.max_tokens > max_model_len:
        raise max_tokens_too_large(sampling.max_tokens_param, sampling.max_tokens, max_model_len)
    # SGLang's own limit (max_req_input_len) stands under its context; a --max-model-len under SGLang's is the
    # smaller one, and the prompt is refused in vLLM's words against it (never as a negative max_tokens)
    if prompt_len > min(max_prompt_len or max_model_len, max_model_len):
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
    if not -(2**63) <= params.get("sampling_seed", 0) < 2**63:  # vLLM takes uint64 seeds; SGLang 0.5.21+ int64
        params["sampling_seed"] %= 2**63
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
    api: SGLangFeatures = VERIFIED_FEATURES,
) -> dict:
    params = sampling_params(sampling, max_new_tokens)
    payload = {"input_ids": prompt_ids, "sampling_params": params, "rid": rid, "stream": stream}
    if _one_item_per_sample(sampling, api):
        payload.update(_sample_batch(prompt_ids, params, rid, sampling.n, sampling.seed))
    return _with_request_fields(payload, sampling, cache_salt, priority, api)


def batch_payload(
    prompts: list[list[int]],
    sampling: SamplingRequest,
    max_new_tokens: list[int],
    *,
    rid: str,
    stream: bool,
    cache_salt: str | None = None,
    priority: int | None = None,
    api: SGLangFeatures = VERIFIED_FEATURES,
) -> dict:
    """Several prompts in one SGLang batch. Choice i*n + j is sample j of prompt i, in SGLang's
    order and in vLLM's (`output.index + prompt_idx * n`)."""
    if len(prompts) == 1:
        return generate_payload(prompts[0], sampling, max_new_tokens[0], rid=rid, stream=stream,
                                cache_salt=cache_salt, priority=priority, api=api)
    per_sample = _one_item_per_sample(sampling, api)
    input_ids, params, rids = [], [], []
    for p, (ids, max_new) in enumerate(zip(prompts, max_new_tokens)):
        one = sampling_params(sampling, max_new)
        items = _sample_batch(ids, one, f"{rid}-{p}", sampling.n, sampling.seed) if per_sample else {
            "input_ids": [ids], "sampling_params": [one], "rid": [f"{rid}-{p}"]}
        input_ids += items["input_ids"]
        params += items["sampling_params"]
        rids += items["rid"]
    payload = {"input_ids": input_ids, "sampling_params": params, "rid": rids, "stream": stream}
    return _with_request_fields(payload, sampling, cache_salt, priority, api)


def _with_request_fields(payload: dict, sampling: SamplingRequest, cache_salt: str | None,
                         priority: int | None, api: SGLangFeatures) -> dict:
    if sampling.logprobs or sampling.prompt_logprobs is not None:
        payload.update(_logprob_fields(sampling))
    if cache_salt is not None:
        # 0.5.17's /generate knows only extra_key (its OpenAI layer folds cache_salt into it; an unknown
        # top-level "cache_salt" would be dropped and the salt lost). From 0.5.18 cache_salt is its own
        # radix-key part, as SGLang's own chat sends it (and KV events carry it). A version the proxy
        # could only guess (a source build, a router that reports none) gets both: isolated either way.
        if api.native_cache_salt:
            payload["cache_salt"] = cache_salt
        if not api.native_cache_salt or not api.exact:
            payload["extra_key"] = cache_salt
    if priority is not None:
        payload["priority"] = priority
    return payload


def _one_item_per_sample(sampling: SamplingRequest, api: SGLangFeatures) -> bool:
    """n > 1 as n one-sample items with the proxy's own rids `<rid>-<i>`, instead of SGLang's `n`:
    - seeded: SGLang samples its n copies with the same seed at the same positions, so they come out
      identical; vLLM's n seeded samples differ (seeds seed, seed+1, ... instead);
    - from 0.5.18 SGLang names the samples of an `n` request with random rids, so /abort_request of
      the request's rid stops none of them (a client that leaves, a stop id the proxy enforces).
    On 0.5.17 an unseeded `n` stays SGLang's own (its prefix is prefilled once, then shared)."""
    return sampling.n > 1 and (sampling.seed is not None or not api.abort_reaches_n_samples)


def _sample_batch(prompt_ids: list[int], params: dict, rid: str, n: int, seed: int | None) -> dict:
    one = dict(params, n=1)
    return {
        "input_ids": [prompt_ids] * n,
        "sampling_params": [one] * n if seed is None else
        [dict(one, sampling_seed=(seed + i) % 2**63) for i in range(n)],
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
