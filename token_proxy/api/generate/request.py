"""POST /inference/v1/generate (token in, token out): vLLM's GenerateRequest, validated."""

from __future__ import annotations

from dataclasses import dataclass

from token_proxy.api.fields import (
    bad,
    opt_bool,
    opt_dict,
    opt_int,
    opt_request_id,
    opt_str,
    token_id_list,
)
from token_proxy.api.sampling import parse_sampling
from token_proxy.errors import InvalidRequest
from token_proxy.vocabulary import SamplingRequest


@dataclass(frozen=True, slots=True)
class GenerateTokensRequest:
    model: str | None
    token_ids: list[int]
    sampling: SamplingRequest
    stream: bool = False
    include_usage: bool = False
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int | None = None


def parse_generate_tokens(body: dict, vocab_size: int) -> GenerateTokensRequest:
    for key in ("features", "content_parts"):
        if body.get(key):
            raise bad(key, "multimodal input is not supported by this proxy")
    if opt_str(body, "output_mode", "tokens") != "tokens":
        raise bad("output_mode", "only 'tokens' is supported")
    stream = opt_bool(body, "stream", False)
    options = opt_dict(body, "stream_options") or {}
    include_usage = opt_bool(options, "include_usage", False)  # checked streamed or not, as /openapi.json says
    opt_bool(options, "continuous_usage_stats")
    return GenerateTokensRequest(
        model=opt_str(body, "model"),
        token_ids=token_id_list(body.get("token_ids"), "token_ids", vocab_size),
        sampling=_nested_sampling(body, vocab_size),
        stream=stream,
        include_usage=stream and include_usage,
        request_id=opt_request_id(body),
        cache_salt=opt_str(body, "cache_salt"),
        priority=opt_int(body, "priority"),
    )


def _nested_sampling(body: dict, vocab_size: int) -> SamplingRequest:
    params = opt_dict(body, "sampling_params") or {}
    try:
        return parse_sampling(params, vocab_size, logprobs_count=True)
    except InvalidRequest as exc:
        param = f"sampling_params.{exc.param}" if exc.param else "sampling_params"
        raise InvalidRequest(exc.message, param=param) from None
