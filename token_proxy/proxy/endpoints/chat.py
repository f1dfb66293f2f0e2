"""POST /v1/chat/completions: parse -> render -> SGLang /generate -> vLLM's schema."""

from __future__ import annotations

import dataclasses

from aiohttp import web

from token_proxy.proxy.http_io import json_response, read_json
from token_proxy.proxy.request_ids import header_request_id, new_request_id, now
from token_proxy.proxy.request_stats import RequestStats, stats_of
from token_proxy.proxy.serving import check_seed, checked_model, generate_once, stream_translated
from token_proxy.proxy.upstream.context import CONTEXT, ProxyContext
from token_proxy.schemas.chat_request import ChatRequest, parse_chat_request
from token_proxy.schemas.chat_response import ResponseMeta, chat_response
from token_proxy.schemas.chat_stream import ChatStreamTranslator
from token_proxy.schemas.fields import token_id_list
from token_proxy.schemas.logprobs import TokenNamer
from token_proxy.schemas.sglang_payload import generate_payload, resolve_max_tokens


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    req = parse_chat_request(await read_json(request), ctx.tokenizer_info.vocab_size)
    return await serve_chat(request, ctx, req)


async def chat_completions_tokens(request: web.Request) -> web.StreamResponse:
    """Older prime-rl/verifiers: a chat request whose prompt is `tokens`, not the rendered messages
    (the messages only give context, such as tools)."""
    ctx = request.app[CONTEXT]
    body = await read_json(request)
    tokens = token_id_list(body.get("tokens"), "tokens", ctx.tokenizer_info.vocab_size)
    req = parse_chat_request(body, ctx.tokenizer_info.vocab_size)
    return await serve_chat(request, ctx, dataclasses.replace(req, prompt_ids=tuple(tokens)))


async def serve_chat(request: web.Request, ctx: ProxyContext, req: ChatRequest) -> web.StreamResponse:
    stats = stats_of(request)
    stats.stream = req.output.stream
    model = checked_model(ctx, req.model)
    check_seed(ctx, req.sampling)
    prompt_ids = await chat_prompt_ids(ctx, req, stats)
    max_new_tokens = resolve_max_tokens(req.sampling, len(prompt_ids), ctx.max_model_len,
                                        ctx.backend.max_prompt_len)
    meta = ResponseMeta(
        response_id=new_request_id("chatcmpl", req.request_id or header_request_id(request)),
        created=now(), model=model, prompt_ids=prompt_ids, eos_token_id=ctx.tokenizer_info.eos_token_id,
    )
    stats.backend_rid = meta.response_id
    payload = generate_payload(prompt_ids, req.sampling, max_new_tokens, rid=meta.response_id,
                               stream=req.output.stream, cache_salt=req.cache_salt, priority=req.priority)
    namer = TokenNamer(ctx.token_texts, req.output.return_tokens_as_token_ids)
    if req.output.stream:
        translator = ChatStreamTranslator(req, meta, namer, ctx.backend.incremental_stream)
        return await stream_translated(request, ctx, payload, translator)
    gens = await generate_once(ctx, payload, stats)
    return json_response(chat_response(req, meta, gens, namer))


async def chat_prompt_ids(ctx: ProxyContext, req: ChatRequest, stats: RequestStats) -> list[int]:
    if req.prompt_ids is not None:
        ids = list(req.prompt_ids)
    else:
        rendered = await ctx.renderer.render_chat(req.prompt)
        ids, stats.prompt_cache_hit, stats.render_s = rendered
    if req.truncate_prompt_tokens is not None and len(ids) > req.truncate_prompt_tokens:
        ids = ids[-req.truncate_prompt_tokens:]
    stats.prompt_tokens = len(ids)
    return ids


