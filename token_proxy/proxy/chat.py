"""POST /v1/chat/completions: parse -> render -> SGLang /generate -> vLLM's schema."""

from __future__ import annotations

import contextlib

from aiohttp import web

from token_proxy.errors import BackendError, BackendTimeout, NotFound, ProxyError
from token_proxy.proxy.context import CONTEXT, ProxyContext, new_request_id, now
from token_proxy.proxy.http_io import DONE, json_response, open_sse, read_json, sse_frames
from token_proxy.proxy.request_stats import RequestStats, stats_of
from token_proxy.proxy.upstream import abort_all_of, aborting_on_exit
from token_proxy.schemas.chat_request import ChatRequest, parse_chat_request
from token_proxy.schemas.chat_response import ResponseMeta, chat_response
from token_proxy.schemas.chat_stream import ChatStreamTranslator
from token_proxy.schemas.generation import Generation, generations
from token_proxy.schemas.logprobs import TokenNamer
from token_proxy.schemas.sglang_payload import generate_payload, payload_rids, resolve_max_tokens


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    req = parse_chat_request(await read_json(request), ctx.tokenizer_info.vocab_size)
    return await serve_chat(request, ctx, req)


async def serve_chat(request: web.Request, ctx: ProxyContext, req: ChatRequest) -> web.StreamResponse:
    stats = stats_of(request)
    stats.stream = req.output.stream
    model = checked_model(ctx, req.model)
    prompt_ids = await chat_prompt_ids(ctx, req, stats)
    max_new_tokens = resolve_max_tokens(req.sampling, len(prompt_ids), ctx.max_model_len,
                                        ctx.backend.max_prompt_len)
    meta = ResponseMeta(
        response_id=new_request_id("chatcmpl", req.request_id or request.headers.get("X-Request-Id")),
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


async def generate_once(ctx: ProxyContext, payload: dict, stats: RequestStats) -> list[Generation]:
    """A non-streaming /generate call, aborted upstream if the client leaves; records what it produced."""
    async with aborting_on_exit(ctx, payload_rids(payload), stats):
        gens = generations(await ctx.client.generate(payload))
    stats.mark_first_token()
    stats.completion_tokens = sum(len(g.token_ids) for g in gens)
    if gens:
        stats.cached_tokens = gens[0].cached_tokens
        stats.weight_version = gens[0].weight_version
    return gens


def translate(translator, events: list[dict]) -> list[dict]:
    return [chunk for event in events for chunk in translator.feed(event)]


def checked_model(ctx: ProxyContext, model: str | None) -> str:
    served = ctx.backend.served_model_name
    if model is not None and model != served:
        raise NotFound(f"The model `{model}` does not exist.", param="model")
    return served


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


async def stream_translated(request: web.Request, ctx: ProxyContext, payload: dict,
                            translator) -> web.StreamResponse:
    """Errors before SGLang's first event are plain HTTP errors; after it, an error chunk + [DONE]."""
    stats = stats_of(request)
    rids = payload_rids(payload)
    async with (aborting_on_exit(ctx, rids, stats),
                contextlib.aclosing(ctx.client.generate_stream(payload)) as batches):
        first = await anext(batches, None)
        if first is None:
            raise BackendError("SGLang closed the stream before sending anything")
        response = await open_sse(request)
        await response.write(sse_frames(translator.start() + translate(translator, first)))
        stats.mark_first_token()
        try:
            await _relay(response, ctx, batches, translator, rids)
        except ProxyError as exc:
            if isinstance(exc, BackendTimeout):
                abort_all_of(ctx, rids)
            await response.write(sse_frames([exc.body()]) + DONE)
        finally:
            _record_stream(stats, translator)
    return response


async def _relay(response: web.StreamResponse, ctx: ProxyContext, batches, translator, rids: list[str]) -> None:
    async for events in batches:
        frames = translate(translator, events)
        if frames:
            await response.write(sse_frames(frames))
        if translator.cut_short and translator.done:
            abort_all_of(ctx, rids)  # SGLang would go on to max_tokens
            break
    if not translator.done:
        raise BackendError("SGLang ended the stream before every choice finished")
    await response.write(sse_frames(translator.finish()) + DONE)


def _record_stream(stats: RequestStats, translator) -> None:
    stats.completion_tokens = translator.completion_tokens
    stats.cached_tokens = translator.cached_tokens
    stats.weight_version = translator.weight_version
