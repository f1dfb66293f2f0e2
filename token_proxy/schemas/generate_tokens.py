"""POST /inference/v1/generate (token in, token out): vLLM's GenerateRequest and its reply.

The reply follows vLLM 0.33's GenerateTokensResponse, and each logprob entry carries
both 0.33's `token_id` and the `"token": "token_id:<id>"` spelling of vLLM <= 0.31,
which the `renderers` client (0.1.12) checks for: both kinds of client accept it.
"""

from __future__ import annotations

from dataclasses import dataclass

from token_proxy.errors import InvalidRequest
from token_proxy.schemas.chat_response import usage
from token_proxy.schemas.fields import (
    bad,
    opt_bool,
    opt_dict,
    opt_int,
    opt_request_id,
    opt_str,
    token_id_list,
)
from token_proxy.schemas.generation import Generation, map_finish
from token_proxy.schemas.logprobs import TokenNamer, clamp, prompt_logprobs
from token_proxy.schemas.sampling import SamplingRequest, parse_sampling
from token_proxy.schemas.stream_deltas import DeltaTracker, StreamTranslator
from token_proxy.schemas.weight_versions import whole_output


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
    return GenerateTokensRequest(
        model=opt_str(body, "model"),
        token_ids=token_id_list(body.get("token_ids"), "token_ids", vocab_size),
        sampling=_nested_sampling(body, vocab_size),
        stream=stream,
        include_usage=stream and opt_bool(options, "include_usage", False),
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


def token_logprobs(triples: list, rows: list | None, top_n: int) -> list[dict]:
    """vLLM's entries: the sampled token with its rank, then the engine's candidates (sampled first)."""
    rows = rows or []
    content = []
    for i, (lp, token_id, *_) in enumerate(triples):
        row = rows[i] if i < len(rows) and rows[i] else []
        ranks = {t: r for r, (_, t, *_) in enumerate(row, start=1)}
        sampled = _entry(token_id, lp, ranks.get(token_id))
        others = [_entry(t, l, ranks[t]) for l, t, *_ in row[:top_n] if t != token_id]
        content.append({**sampled, "top_logprobs": [dict(sampled), *others]})
    return content


def _entry(token_id: int, logprob, rank: int | None) -> dict:
    return {"token_id": token_id, "token": f"token_id:{token_id}", "logprob": clamp(logprob), "rank": rank}


def tokens_choice(req: GenerateTokensRequest, gen: Generation, eos_token_id: int | None) -> dict:
    finish_reason, stop_reason = map_finish(gen.finish, None if req.sampling.ignore_eos else eos_token_id)
    logprobs = None
    if req.sampling.logprobs:
        logprobs = {"content": token_logprobs(gen.meta.get("output_token_logprobs") or [],
                                              gen.meta.get("output_top_logprobs"), req.sampling.top_logprobs)}
    return {"index": gen.index, "finish_reason": finish_reason or "stop", "stop_reason": stop_reason,
            "token_ids": gen.token_ids, "routed_experts": None, "sampling_mask": None,
            "weight_versions": whole_output(gen.weight_version, len(gen.token_ids)), "logprobs": logprobs}


def generate_tokens_response(req: GenerateTokensRequest, request_id: str, model: str, created: int,
                             gens: list[Generation], eos_token_id: int | None, namer: TokenNamer) -> dict:
    gens = sorted(gens, key=lambda g: g.index)
    completion = sum(len(g.token_ids) for g in gens)
    prompt_lps = None
    if req.sampling.prompt_logprobs is not None and gens:
        prompt_lps = prompt_logprobs(gens[0].meta.get("input_token_logprobs") or [],
                                     gens[0].meta.get("input_top_logprobs"), req.sampling.prompt_logprobs, namer)
    return {
        "request_id": request_id,
        "model": model,
        "created": created,
        "usage": usage(len(req.token_ids), completion, gens[0].cached_tokens if gens else 0),
        "prompt_logprobs": prompt_lps,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": req.token_ids,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [tokens_choice(req, g, eos_token_id) for g in gens],
    }


class GenerateStreamTranslator(StreamTranslator):
    """Stream deltas -> vLLM's generate-tokens chunks (prompt ids on the first chunk only)."""

    def __init__(self, req: GenerateTokensRequest, request_id: str, eos_token_id: int | None, incremental: bool):
        self._req = req
        self._request_id = request_id
        self._eos = eos_token_id
        self._deltas = DeltaTracker(req.sampling, req.sampling.n, incremental, lambda ids: "")
        self._sent_first = False

    def feed(self, event: dict) -> list[dict]:
        delta = self._deltas.feed(event)
        if delta is None:
            return []
        gen = Generation(delta.index, delta.text, delta.token_ids, delta.finish,
                         {"output_token_logprobs": delta.logprobs, "output_top_logprobs": delta.top_logprobs})
        choice = tokens_choice(self._req, gen, self._eos)
        choice["weight_versions"] = delta.weight_versions
        if delta.finish is None:
            choice["finish_reason"] = None
        chunk = {"request_id": self._request_id, "usage": None}
        if not self._sent_first:
            chunk.update(prompt_token_ids=self._req.token_ids, mm_placeholders=None)
            self._sent_first = True
        chunk.update(output_mode="tokens", choices=[choice])
        return [chunk]

    def finish(self) -> list[dict]:
        if not self._req.include_usage:
            return []
        report = usage(len(self._req.token_ids), self._deltas.completion_tokens, self._deltas.cached_tokens)
        return [{"request_id": self._request_id, "usage": {k: v for k, v in report.items() if v is not None},
                 "output_mode": "tokens", "choices": []}]
