"""Parse a /generate body into the sequences to run, refusing it the way SGLang 0.5.17 does."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from token_proxy.simulator.config import SimConfig
from token_proxy.simulator.constrained import with_forced_outputs
from token_proxy.simulator.errors import BadRequest, RequestValidationError
from token_proxy.simulator.sampling_params import SamplingParams, check_known_keys, parse_sampling_params


class ModelCrash(Exception):
    """An input id outside the embedding table: a real server dies on a CUDA assert."""


@dataclass(frozen=True)
class LogprobOptions:
    start_len: int  # -1: output tokens only
    top_n: int  # top_logprobs_num
    token_ids: tuple[int, ...] | None  # token_ids_logprob
    with_text: bool  # return_text_in_logprobs


@dataclass(frozen=True)
class SequenceSpec:
    rid: str
    logical_rid: str  # the rid a client can abort; differs from rid for n > 1 children
    index: int  # position in the response array / the "index" of stream events
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int  # after SGLang's clamp to the context length
    logprobs: LogprobOptions | None
    return_prompt_token_ids: bool
    input_error: str | None  # the scheduler's own length check, reported as an abort
    forced_ids: tuple[int, ...] = ()  # a json_schema constraint's output (simulator/constrained.py)
    lora: tuple[str, str] | None = None  # (name, path) of its LoRA adapter (lora.with_adapters)
    extra_key: str | None = None  # SGLang keys its radix cache by it (cache_salt): no sharing across keys


@dataclass(frozen=True)
class GenerateCall:
    sequences: list[SequenceSpec]
    stream: bool
    is_batch: bool  # reply is a JSON array; stream events carry "index"


def parse_generate(body, config: SimConfig, encode) -> GenerateCall:
    """`encode(text) -> ids` tokenizes text prompts."""
    _check_body_types(body)
    raw_params = body.get("sampling_params") or {}
    for raw in raw_params if isinstance(raw_params, list) else [raw_params]:
        check_known_keys(raw, config)
    prompts, is_single = _prompts(body, encode)
    n = _parallel_sample_num(raw_params)
    rids = _logical_rids(body.get("rid"), len(prompts), is_single and n == 1)
    extra_keys = _extra_keys(body.get("extra_key"), len(prompts))
    if config.since("0.5.18"):  # cache_salt: its own radix-key part (0.5.17 ignores the key)
        salts = _extra_keys(body.get("cache_salt") or None, len(prompts), "cache_salt")
        extra_keys = [k if s is None else f"{k or ''}\x00salt:{s}" for k, s in zip(extra_keys, salts)]
    items = [replace(_item(body, i, prompt, rids[i], raw_params, config), extra_key=extra_keys[i])
             for i, prompt in enumerate(prompts)]
    _check_vocab(prompts, config.model_vocab_size)
    sequences = with_forced_outputs(_expand(items, n, prefixed=not config.since("0.5.18")), encode,
                                    config.scripted_output)
    return GenerateCall(
        sequences=sequences, stream=bool(body.get("stream")), is_batch=not (is_single and n == 1)
    )


def _prompts(body: dict, encode) -> tuple[list[list[int]], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if input_ids is not None:
        if len(input_ids) == 0:
            raise BadRequest("input_ids cannot be empty.")
        single = isinstance(input_ids[0], int)
        return ([list(input_ids)] if single else [list(ids) for ids in input_ids]), single
    if text is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    single = isinstance(text, str)
    return [encode(t) for t in ([text] if single else text)], single


def _extra_keys(extra_key, batch_size: int, name: str = "extra_key") -> list[str | None]:
    """GenerateReqInput._normalize_extra_key (and 0.5.18's _normalize_cache_salt): one string for
    every prompt, or one per prompt."""
    if extra_key is None or isinstance(extra_key, str):
        return [extra_key] * batch_size
    if isinstance(extra_key, list):
        if len(extra_key) != batch_size:
            raise BadRequest(f"The length of {name} should be equal to the batch size.")
        return list(extra_key)
    raise BadRequest(f"{name} should be a list or a string.")


def _parallel_sample_num(raw_params) -> int:
    if isinstance(raw_params, dict):
        return raw_params.get("n") or 1
    n = (raw_params[0].get("n") or 1) if raw_params else 1
    if any((p.get("n") or 1) != n for p in raw_params):
        raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
    return n


def _logical_rids(rid, batch_size: int, single: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(batch_size)]
    if isinstance(rid, str):
        return [rid] if single or batch_size == 1 else [f"{rid}_{i}" for i in range(batch_size)]
    if len(rid) != batch_size:
        raise BadRequest("The specified rids length mismatch with the batch_size for batch processing.")
    if len(set(rid)) != len(rid):
        duplicates = sorted({r for r in rid if rid.count(r) > 1})
        raise BadRequest(f"Duplicate request IDs detected within the request: {duplicates}")
    return list(rid)


def _item(body: dict, i: int, prompt: list[int], rid: str, raw_params, config: SimConfig) -> SequenceSpec:
    raw = (raw_params[i] if i < len(raw_params) else {}) if isinstance(raw_params, list) else raw_params
    _check_context(len(prompt), raw.get("max_new_tokens"), config.context_length)
    params = parse_sampling_params(raw, config.model_vocab_size)
    seed = params.sampling_seed
    if seed is not None and config.since("0.5.21") and not -(2**63) <= seed <= 2**63 - 1:
        raise BadRequest(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    if not config.enable_deterministic_inference:
        params = replace(params, sampling_seed=None)  # accepted, then ignored, as in SGLang
    requested = params.max_new_tokens if params.max_new_tokens is not None else 1 << 30
    too_long = len(prompt) >= config.max_req_input_len
    return SequenceSpec(
        rid=rid,
        logical_rid=rid,
        index=i,
        prompt=prompt,
        params=params,
        max_new_tokens=max(0, min(requested, config.max_req_len - len(prompt) - 1)),
        logprobs=_logprob_options(body, i),
        return_prompt_token_ids=bool(body.get("return_prompt_token_ids")),
        input_error=_input_length_error(len(prompt), config.max_req_input_len) if too_long else None,
    )


def _check_context(num_input: int, max_new_tokens, context: int) -> None:
    """TokenizerManager._validate_one_request, messages verbatim.

    The total check only runs when max_new_tokens was sent explicitly: an absent
    key (default 128) is clamped later by the scheduler instead of refused.
    """
    if num_input >= context:
        raise BadRequest(
            f"The input ({num_input} tokens) is longer than the model's context length ({context} tokens)."
        )
    if max_new_tokens is not None and max_new_tokens + num_input > context:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. "
            f"You requested a total of {max_new_tokens + num_input} tokens: {num_input} tokens from the "
            f"input messages and {max_new_tokens} tokens for the completion. Please reduce the number of "
            f"tokens in the input messages or the completion to fit within the limit."
        )


def _input_length_error(num_input: int, limit: int) -> str:
    return (
        f"Input length ({num_input} tokens) exceeds the maximum allowed length ({limit} tokens). "
        f"Use a shorter input or enable --allow-auto-truncate."
    )


def _logprob_options(body: dict, i: int) -> LogprobOptions | None:
    if not _per_item(body.get("return_logprob"), i, False):
        return None
    token_ids = body.get("token_ids_logprob")
    if token_ids and isinstance(token_ids[0], list):
        token_ids = token_ids[i]
    return LogprobOptions(
        start_len=_per_item(body.get("logprob_start_len"), i, -1),
        top_n=_per_item(body.get("top_logprobs_num"), i, 0) or 0,
        token_ids=tuple(token_ids) if token_ids else None,
        with_text=bool(body.get("return_text_in_logprobs")),
    )


def _per_item(value, i: int, default):
    if value is None:
        return default
    return value[i] if isinstance(value, list) else value


def _check_vocab(prompts: list[list[int]], vocab_size: int) -> None:
    if any(not 0 <= token_id < vocab_size for prompt in prompts for token_id in prompt):
        raise ModelCrash("input id outside the embedding table")


def _expand(items: list[SequenceSpec], n: int, prefixed: bool) -> list[SequenceSpec]:
    """n > 1: SGLang makes n children per item, index item * n + k, rid "<logical>_<uuid>" (0.5.17:
    an abort of the logical rid reaches them) or, from 0.5.18, a bare uuid (an abort of it does not)."""
    if n == 1:
        return items
    return [_child(item, item.index * n + k, prefixed) for item in items for k in range(n)]


def _child(item: SequenceSpec, index: int, prefixed: bool) -> SequenceSpec:
    child = uuid.uuid4().hex
    return replace(item, rid=f"{item.logical_rid}_{child}" if prefixed else child, index=index)


def _check_body_types(body) -> None:
    """The part of FastAPI's GenerateReqInput validation a client can trip over."""
    if not isinstance(body, dict):
        raise RequestValidationError(
            [
                {
                    "type": "dataclass_type",
                    "loc": ("body",),
                    "msg": "Input should be a dictionary or an instance of GenerateReqInput",
                    "input": body,
                }
            ]
        )
    errors = [
        _type_error(key, body[key])
        for key, check in _BODY_TYPES.items()
        if body.get(key) is not None and not check(body[key])
    ]
    if errors:
        raise RequestValidationError(errors)


def _type_error(key: str, value) -> dict:
    return {
        "type": "union_type" if key in _UNIONS else "bool_type",
        "loc": ("body", key),
        "msg": f"Input should be a valid {_BODY_TYPE_NAMES.get(key, 'value')}",
        "input": value,
    }


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _list_of(check):
    return lambda value: isinstance(value, list) and all(map(check, value))


def _one_or_list(check):
    return lambda value: check(value) or _list_of(check)(value)


def _ids_or_batch(value) -> bool:
    return _list_of(_is_int)(value) or _list_of(_list_of(_is_int))(value)


_BODY_TYPES = {
    "text": _one_or_list(lambda v: isinstance(v, str)),
    "input_ids": _ids_or_batch,
    "sampling_params": _one_or_list(lambda v: isinstance(v, dict)),
    "rid": _one_or_list(lambda v: isinstance(v, str)),
    "stream": lambda v: isinstance(v, bool),
    "return_logprob": _one_or_list(lambda v: isinstance(v, bool)),
    "logprob_start_len": _one_or_list(_is_int),
    "top_logprobs_num": _one_or_list(_is_int),
    "token_ids_logprob": _ids_or_batch,
    "return_text_in_logprobs": lambda v: isinstance(v, bool),
}
_UNIONS = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
}
_BODY_TYPE_NAMES = {
    "text": "string or list of strings",
    "input_ids": "list of integers or list of lists",
    "sampling_params": "dictionary or list of dictionaries",
    "rid": "string or list of strings",
}
