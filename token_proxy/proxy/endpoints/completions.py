"""POST /v1/completions: text or token-id prompts (one or many) -> SGLang /generate -> vLLM's schema."""

from __future__ import annotations

import asyncio

from aiohttp import web

from token_proxy.proxy.http_io import json_response, read_json
from token_proxy.proxy.request_ids import header_request_id, new_request_id, now
from token_proxy.proxy.request_stats import stats_of
from token_proxy.proxy.serving import check_seed, checked_model, generate_once, stream_translated
from token_proxy.proxy.upstream.context import CONTEXT, ProxyContext
from token_proxy.schemas.completion_request import CompletionRequest, parse_completion_request
from token_proxy.schemas.completion_response import (
    CompletionMeta,
    CompletionStreamTranslator,
    completion_response,
)
from token_proxy.schemas.logprobs import TokenNamer
from token_proxy.schemas.sglang_payload import batch_payload, resolve_max_tokens


async def completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    req = parse_completion_request(await read_json(request), ctx.tokenizer_info.vocab_size)
    stats = stats_of(request)
    stats.stream = req.output.stream
    model = checked_model(ctx, req.model)
    check_seed(ctx, req.sampling)
    prompt_ids = await _prompt_ids(ctx, req)
    stats.prompt_tokens = sum(len(ids) for ids in prompt_ids)
    max_new = [resolve_max_tokens(req.sampling, len(ids), ctx.max_model_len, ctx.backend.max_prompt_len)
               for ids in prompt_ids]
    meta = CompletionMeta(
        response_id=new_request_id("cmpl", req.request_id or header_request_id(request)), created=now(),
        model=model, prompt_ids=prompt_ids, prompt_texts=await _prompt_texts(ctx, req, prompt_ids),
        eos_token_id=ctx.tokenizer_info.eos_token_id,
    )
    stats.backend_rid = meta.response_id
    payload = batch_payload(prompt_ids, req.sampling, max_new, rid=meta.response_id, stream=req.output.stream,
                            cache_salt=req.cache_salt, priority=req.priority)
    namer = TokenNamer(ctx.token_texts, req.output.return_tokens_as_token_ids)
    if req.output.stream:
        translator = CompletionStreamTranslator(req, meta, namer, ctx.backend.incremental_stream)
        return await stream_translated(request, ctx, payload, translator)
    gens = await generate_once(ctx, payload, stats)
    return json_response(completion_response(req, meta, gens, namer))


async def _prompt_ids(ctx: ProxyContext, req: CompletionRequest) -> list[list[int]]:
    async def ids_of(prompt) -> list[int]:
        ids = await ctx.renderer.encode(prompt, req.add_special_tokens) if isinstance(prompt, str) else prompt
        if req.truncate_prompt_tokens is not None and len(ids) > req.truncate_prompt_tokens:
            ids = ids[-req.truncate_prompt_tokens:]
        return ids

    return list(await asyncio.gather(*(ids_of(p) for p in req.prompts)))


async def _prompt_texts(ctx: ProxyContext, req: CompletionRequest, prompt_ids: list[list[int]]) -> list[str]:
    """Only echo needs the prompt text; token-id prompts are decoded for it."""
    if not req.echo:
        return [""] * len(prompt_ids)
    loop = asyncio.get_running_loop()
    return [p if isinstance(p, str) else await loop.run_in_executor(ctx.renderer.executor, ctx.token_texts.decode,
                                                                     ids, False)
            for p, ids in zip(req.prompts, prompt_ids)]
