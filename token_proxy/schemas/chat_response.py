"""vLLM's non-streaming chat completion body, built from SGLang generations (pure functions).

Every key vLLM 0.33 emits is present, in its order, null when not requested.
"""

from __future__ import annotations

from dataclasses import dataclass

from token_proxy.schemas.chat_request import ChatRequest
from token_proxy.schemas.generation import Generation, cut_at_stop_ids, map_finish
from token_proxy.schemas.logprobs import TokenNamer, chat_logprob_content, prompt_logprobs
from token_proxy.schemas.weight_versions import whole_output


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """Per-response facts the builders need besides the request and the generations."""

    response_id: str
    created: int
    model: str
    prompt_ids: list[int]
    eos_token_id: int | None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    """vLLM's UsageInfo, in its key order; cached_tokens is what SGLang's prefix cache reused."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
        "completion_tokens_details": None,
    }


def assistant_message(content: str) -> dict:
    # vLLM drops `tool_calls` when empty; content is "" (not null) for empty output.
    return {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "reasoning": None}


def chat_choice(req: ChatRequest, meta: ResponseMeta, gen: Generation, namer: TokenNamer) -> dict:
    eos = None if req.sampling.ignore_eos else meta.eos_token_id
    finish_reason, stop_reason = map_finish(gen.finish, eos)
    return {
        "index": gen.index,
        "message": assistant_message(gen.text),
        "logprobs": _choice_logprobs(req, gen, namer),
        "finish_reason": finish_reason or "stop",
        "stop_reason": stop_reason,
        "token_ids": gen.token_ids if req.output.return_token_ids else None,
        "routed_experts": None,
        "weight_versions": whole_output(gen.weight_version, len(gen.token_ids)),
    }


def _choice_logprobs(req: ChatRequest, gen: Generation, namer: TokenNamer) -> dict | None:
    if not req.sampling.logprobs:
        return None
    triples = gen.meta.get("output_token_logprobs") or []
    rows = gen.meta.get("output_top_logprobs")
    return {"content": chat_logprob_content(triples, rows, req.sampling.top_logprobs, namer)}


def request_prompt_logprobs(req_prompt_logprobs: int | None, gen: Generation, namer: TokenNamer) -> list | None:
    if req_prompt_logprobs is None:
        return None
    return prompt_logprobs(gen.meta.get("input_token_logprobs") or [], gen.meta.get("input_top_logprobs"),
                           req_prompt_logprobs, namer)


def enforce_stop_ids(req: ChatRequest, gens: list[Generation], namer: TokenNamer) -> list[Generation]:
    stop_ids = req.sampling.proxy_stop_ids
    if not stop_ids:
        return gens
    skip = req.sampling.skip_special_tokens
    return [cut_at_stop_ids(g, stop_ids, lambda ids: namer.decode(ids, skip)) for g in gens]


def chat_response(req: ChatRequest, meta: ResponseMeta, gens: list[Generation], namer: TokenNamer) -> dict:
    gens = sorted(enforce_stop_ids(req, gens, namer), key=lambda g: g.index)
    completion_tokens = sum(len(g.token_ids) for g in gens)
    return {
        "id": meta.response_id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [chat_choice(req, meta, g, namer) for g in gens],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(len(meta.prompt_ids), completion_tokens, gens[0].cached_tokens if gens else 0),
        "prompt_logprobs": request_prompt_logprobs(req.sampling.prompt_logprobs, gens[0], namer) if gens else None,
        "prompt_token_ids": meta.prompt_ids if req.output.return_token_ids else None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
