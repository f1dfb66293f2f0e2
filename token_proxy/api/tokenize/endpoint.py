"""POST /tokenize and /detokenize (root and /v1), in vLLM's request and response shapes."""

from __future__ import annotations

import asyncio

from aiohttp import web

from token_proxy.api.fields import bad, opt_bool, opt_str, token_id_list
from token_proxy.api.messages import parse_chat_prompt
from token_proxy.http_io import json_response, read_json
from token_proxy.pipeline.run import resolve_target
from token_proxy.state import upstream_of


async def tokenize(request: web.Request) -> web.Response:
    ctx = upstream_of(request.app)
    body = await read_json(request)
    (await resolve_target(request.app, ctx, opt_str(body, "model"))).release()  # a known model or adapter
    if "messages" in body:
        ids = (await ctx.renderer.render_chat(parse_chat_prompt(body))).ids
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("prompt", "must be a string (or send `messages` for a chat)")
        ids = await ctx.renderer.encode(prompt, opt_bool(body, "add_special_tokens", True))
    token_strs = None
    if opt_bool(body, "return_token_strs", False):
        token_strs = await _in_executor(ctx, ctx.renderer.tokenizer.convert_ids_to_tokens, ids)
    return json_response({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
                          "token_strs": token_strs})


async def detokenize(request: web.Request) -> web.Response:
    ctx = upstream_of(request.app)
    body = await read_json(request)
    (await resolve_target(request.app, ctx, opt_str(body, "model"))).release()  # a known model or adapter
    ids = token_id_list(body.get("tokens"), "tokens", ctx.tokenizer_info.vocab_size, allow_empty=True)
    text = await _in_executor(ctx, ctx.token_texts.decode, ids, False)
    return json_response({"prompt": text})


async def _in_executor(ctx, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(ctx.renderer.executor, fn, *args)
