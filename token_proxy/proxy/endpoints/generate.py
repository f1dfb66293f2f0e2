"""POST /inference/v1/generate: token ids in, token ids out (what prime-rl's renderers client calls)."""

from __future__ import annotations

from aiohttp import web

from token_proxy.proxy.http_io import json_response, read_json
from token_proxy.proxy.request_ids import header_request_id, new_request_id, now
from token_proxy.proxy.request_stats import stats_of
from token_proxy.proxy.serving import check_seed, checked_model, generate_once, stream_translated
from token_proxy.proxy.upstream.context import CONTEXT
from token_proxy.schemas.generate_tokens import (
    GenerateStreamTranslator,
    generate_tokens_response,
    parse_generate_tokens,
)
from token_proxy.schemas.logprobs import TokenNamer
from token_proxy.schemas.sglang_payload import generate_payload, resolve_max_tokens


async def generate_tokens(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    req = parse_generate_tokens(await read_json(request), ctx.tokenizer_info.vocab_size)
    stats = stats_of(request)
    stats.stream, stats.prompt_tokens = req.stream, len(req.token_ids)
    model = checked_model(ctx, req.model)
    check_seed(ctx, req.sampling)
    max_new_tokens = resolve_max_tokens(req.sampling, len(req.token_ids), ctx.max_model_len,
                                        ctx.backend.max_prompt_len)
    request_id = new_request_id("generate-tokens", req.request_id or header_request_id(request))
    stats.backend_rid = request_id
    payload = generate_payload(req.token_ids, req.sampling, max_new_tokens, rid=request_id, stream=req.stream,
                               cache_salt=req.cache_salt, priority=req.priority)
    eos = ctx.tokenizer_info.eos_token_id
    if req.stream:
        translator = GenerateStreamTranslator(req, request_id, eos, ctx.backend.incremental_stream)
        return await stream_translated(request, ctx, payload, translator)
    gens = await generate_once(ctx, payload, stats)
    namer = TokenNamer(ctx.token_texts, as_ids=True)
    return json_response(generate_tokens_response(req, request_id, model, now(), gens, eos, namer))
