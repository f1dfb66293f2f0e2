"""POST /v1/chat/completions: parse -> render -> SGLang /generate -> vLLM's schema."""

from __future__ import annotations

import contextlib

from aiohttp import web

from token_proxy.errors import BackendError, BackendTimeout, NotFound, ProxyError
from token_proxy.proxy.context import CONTEXT, ProxyContext, new_request_id, now
from token_proxy.proxy.http_io import DONE, json_response, open_sse, read_json, sse_frames
from token_proxy.proxy.upstream import abort_all_of, aborting_on_exit
from token_proxy.schemas.chat_request import ChatRequest, parse_chat_request
from token_proxy.schemas.chat_response import ResponseMeta, chat_response
from token_proxy.schemas.chat_stream import ChatStreamTranslator
from token_proxy.schemas.generation import generations
from token_proxy.schemas.logprobs import TokenNamer
from token_proxy.schemas.sglang_payload import generate_payload, payload_rids, resolve_max_tokens


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    req = parse_chat_request(await read_json(request), ctx.tokenizer_info.vocab_size)
    return await serve_chat(request, ctx, req)


async def serve_chat(request: web.Request, ctx: ProxyContext, req: ChatRequest) -> web.StreamResponse:
    model = checked_model(ctx, req.model)
    prompt_ids = await chat_prompt_ids(ctx, req)
    max_new_tokens = resolve_max_tokens(req.sampling, len(prompt_ids), ctx.max_model_len,
                                        ctx.backend.max_prompt_len)
    meta = ResponseMeta(
        response_id=new_request_id("chatcmpl", req.request_id or request.headers.get("X-Request-Id")),
        created=now(), model=model, prompt_ids=prompt_ids, eos_token_id=ctx.tokenizer_info.eos_token_id,
    )
    payload = generate_payload(prompt_ids, req.sampling, max_new_tokens, rid=meta.response_id,
                               stream=req.output.stream, cache_salt=req.cache_salt, priority=req.priority)
    namer = TokenNamer(ctx.token_texts, req.output.return_tokens_as_token_ids)
    if req.output.stream:
        translator = ChatStreamTranslator(req, meta, namer, ctx.backend.incremental_stream)
        return await stream_translated(request, ctx, payload, translator)
    async with aborting_on_exit(ctx, payload_rids(payload)):
        raw = await ctx.client.generate(payload)
    return json_response(chat_response(req, meta, generations(raw), namer))


def translate(translator, events: list[dict]) -> list[dict]:
    return [chunk for event in events for chunk in translator.feed(event)]


def checked_model(ctx: ProxyContext, model: str | None) -> str:
    served = ctx.backend.served_model_name
    if model is not None and model != served:
        raise NotFound(f"The model `{model}` does not exist.", param="model")
    return served


async def chat_prompt_ids(ctx: ProxyContext, req: ChatRequest) -> list[int]:
    if req.prompt_ids is not None:
        ids = list(req.prompt_ids)
    else:
        ids = await ctx.renderer.render_chat(req.prompt)
    if req.truncate_prompt_tokens is not None and len(ids) > req.truncate_prompt_tokens:
        ids = ids[-req.truncate_prompt_tokens:]
    return ids


async def stream_translated(request: web.Request, ctx: ProxyContext, payload: dict,
                            translator) -> web.StreamResponse:
    """Errors before SGLang's first event are plain HTTP errors; after it, an error chunk + [DONE]."""
    rids = payload_rids(payload)
    async with aborting_on_exit(ctx, rids), contextlib.aclosing(ctx.client.generate_stream(payload)) as batches:
        first = await anext(batches, None)
        if first is None:
            raise BackendError("SGLang closed the stream before sending anything")
        response = await open_sse(request)
        await response.write(sse_frames(translator.start() + translate(translator, first)))
        try:
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
        except ProxyError as exc:
            if isinstance(exc, BackendTimeout):
                abort_all_of(ctx, rids)
            await response.write(sse_frames([exc.body()]) + DONE)
    return response
