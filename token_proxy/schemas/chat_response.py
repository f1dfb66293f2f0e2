"""vLLM's non-streaming chat completion body, built from SGLang generations (pure functions)."""

from __future__ import annotations

from dataclasses import dataclass

from token_proxy.schemas.chat_request import ChatRequest
from token_proxy.schemas.generation import Generation, map_finish
from token_proxy.schemas.logprobs import TokenNamer, chat_logprob_content


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """Per-response facts the builders need besides the request and the generations."""

    response_id: str
    created: int
    model: str
    prompt_ids: list[int]
    eos_token_id: int | None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
    }


def assistant_message(content: str | None) -> dict:
    return {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": [], "reasoning": None}


def chat_choice(req: ChatRequest, meta: ResponseMeta, gen: Generation, namer: TokenNamer) -> dict:
    eos = None if req.sampling.ignore_eos else meta.eos_token_id
    finish_reason, stop_reason = map_finish(gen.finish, eos)
    return {
        "index": gen.index,
        "message": assistant_message(gen.text),
        "logprobs": _choice_logprobs(req, gen, namer),
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": gen.token_ids if req.output.return_token_ids else None,
    }


def _choice_logprobs(req: ChatRequest, gen: Generation, namer: TokenNamer) -> dict | None:
    if not req.sampling.logprobs:
        return None
    triples = gen.meta.get("output_token_logprobs") or []
    rows = gen.meta.get("output_top_logprobs")
    return {"content": chat_logprob_content(triples, rows, req.sampling.top_logprobs, namer)}


def chat_response(req: ChatRequest, meta: ResponseMeta, gens: list[Generation], namer: TokenNamer) -> dict:
    completion_tokens = sum(g.completion_tokens for g in gens)
    return {
        "id": meta.response_id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [chat_choice(req, meta, g, namer) for g in sorted(gens, key=lambda g: g.index)],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(len(meta.prompt_ids), completion_tokens, gens[0].cached_tokens if gens else 0),
        "prompt_logprobs": None,
        "prompt_token_ids": meta.prompt_ids if req.output.return_token_ids else None,
        "kv_transfer_params": None,
    }
