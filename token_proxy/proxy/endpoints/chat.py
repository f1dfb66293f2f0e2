"""POST /v1/chat/completions and /v1/chat/completions/tokens: the chat adapter of the pipeline."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from aiohttp import web

from token_proxy.proxy.http_io import read_json
from token_proxy.proxy.pipeline import Job, run_pipeline
from token_proxy.proxy.request_stats import RequestStats
from token_proxy.proxy.upstream.context import CONTEXT, ProxyContext
from token_proxy.schemas.chat_format import PLAIN_TEXT, ChatFormatter, ChatOutputParser
from token_proxy.schemas.chat_request import ChatRequest, parse_chat_request
from token_proxy.schemas.fields import token_id_list
from token_proxy.schemas.logprobs import TokenNamer
from token_proxy.schemas.output_rules import ResponseMeta


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    req = parse_chat_request(await read_json(request), ctx.tokenizer_info.vocab_size)
    return await run_pipeline(request, ChatEndpoint(req))


async def chat_completions_tokens(request: web.Request) -> web.StreamResponse:
    """Older prime-rl/verifiers: a chat request whose prompt is `tokens`, not the rendered messages
    (the messages only give context, such as tools)."""
    ctx = request.app[CONTEXT]
    body = await read_json(request)
    tokens = token_id_list(body.get("tokens"), "tokens", ctx.tokenizer_info.vocab_size)
    req = parse_chat_request(body, ctx.tokenizer_info.vocab_size)
    return await run_pipeline(request, ChatEndpoint(dataclasses.replace(req, prompt_ids=tuple(tokens))))


def output_parser(req: ChatRequest) -> ChatOutputParser:
    """The output-parser hook: tool calls (req.prompt.tools) and reasoning parsers plug in here."""
    return PLAIN_TEXT


@dataclass(slots=True)
class ChatEndpoint:
    req: ChatRequest
    job: Job = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        req = self.req
        self.job = Job("chatcmpl", req.model, req.sampling, req.output.stream, req.request_id, req.cache_salt,
                       req.priority)

    async def prompt_ids(self, ctx: ProxyContext, stats: RequestStats) -> list[list[int]]:
        req = self.req
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
        else:
            ids, stats.prompt_cache_hit, stats.render_s = await ctx.renderer.render_chat(req.prompt)
        if req.truncate_prompt_tokens is not None and len(ids) > req.truncate_prompt_tokens:
            ids = ids[-req.truncate_prompt_tokens:]
        return [ids]

    async def formatter(self, ctx: ProxyContext, meta: ResponseMeta) -> ChatFormatter:
        namer = TokenNamer(ctx.token_texts, self.req.output.return_tokens_as_token_ids)
        return ChatFormatter(self.req, meta, namer, output_parser(self.req))
