"""POST /v1/chat/completions, /v1/chat/completions/tokens and /v1/chat/completions/render: the chat
adapter of the pipeline (render runs its parse step and `prepare`, and stops before SGLang)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from aiohttp import web

from token_proxy.api.chat.format import PLAIN_TEXT, ChatFormatter, ChatOutputParser, ToolsAndReasoning
from token_proxy.api.chat.render import render_response
from token_proxy.api.chat.request import ChatFeatures, ChatRequest, ToolFlags, parse_chat_request
from token_proxy.api.chat.sessions import ChatSession
from token_proxy.api.fields import token_id_list
from token_proxy.api.logprobs import TokenNamer
from token_proxy.errors import InvalidRequest
from token_proxy.http_io import json_response, read_json
from token_proxy.pipeline.job import Job
from token_proxy.pipeline.request_state import RequestStats, stats_of
from token_proxy.pipeline.run import prepare, run_pipeline
from token_proxy.sglang.payload import with_sampling_overrides
from token_proxy.state import Upstream, upstream_of
from token_proxy.vocabulary import ResponseMeta


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = upstream_of(request.app)
    body = await read_json(request)
    flags = tool_flags(ctx)
    req = parse_chat_request(body, ctx.tokenizer_info.vocab_size, flags)
    features = ChatFeatures.for_request(req, body, request.headers, flags)  # None: a plain chat
    session = ChatSession.of(request, features.session_key) if features and features.session_key else None
    return await run_pipeline(request, ctx, ChatEndpoint(req, features, session))


async def chat_completions_tokens(request: web.Request) -> web.StreamResponse:
    """Older prime-rl/verifiers: a chat request whose prompt is `tokens`, not the rendered messages
    (the messages only give context, such as tools)."""
    ctx = upstream_of(request.app)
    body = await read_json(request)
    tokens = token_id_list(body.get("tokens"), "tokens", ctx.tokenizer_info.vocab_size)
    flags = tool_flags(ctx)
    req = parse_chat_request(body, ctx.tokenizer_info.vocab_size, flags)
    req = dataclasses.replace(req, prompt_ids=tuple(tokens))
    return await run_pipeline(request, ctx, ChatEndpoint(req, ChatFeatures.for_request(req, body, None, flags)))


async def chat_completions_render(request: web.Request) -> web.Response:
    """vLLM's render: the chat request parsed, then the pipeline's own `prepare` (model, seed rule, prompt
    ids, limits, response id) exactly as /v1/chat/completions runs it, answered as vLLM's GenerateRequest
    (token_ids, sampling_params, ...) without calling SGLang. SkyRL reads `token_ids` and `features`."""
    ctx = upstream_of(request.app)
    body = await read_json(request)
    if isinstance(body, dict) and body.get("use_beam_search"):
        raise InvalidRequest("Beam search is not supported by the render endpoint")  # vLLM's words
    flags = tool_flags(ctx)
    req = parse_chat_request(body, ctx.tokenizer_info.vocab_size, flags)
    endpoint = ChatEndpoint(req, ChatFeatures.for_request(req, body, None, flags))
    prepared = await prepare(request, ctx, endpoint, stats_of(request))
    prepared.target.release()  # a known model or adapter (vLLM's 404); nothing is generated
    (ids,), (max_tokens,) = prepared.prompts, prepared.limits
    reasoning_kwargs = dict(req.prompt.chat_template_kwargs or {}) if ctx.settings.reasoning_parser else None
    return json_response(render_response(req, prepared.sampling, ids, max_tokens, prepared.response_id, body,
                                         reasoning_kwargs))


def tool_flags(ctx: Upstream) -> ToolFlags:
    settings = ctx.settings
    return ToolFlags(ctx.tool_parser, settings.enable_auto_tool_choice, settings.exclude_tools_when_tool_choice_none,
                     settings.reasoning_parser, settings.tool_call_streaming)


def output_parser(req: ChatRequest, features: ChatFeatures | None) -> ChatOutputParser:
    """The output-parser hook: plain text (no work per chunk) unless tools or reasoning are parsed."""
    parsing = features.parsing if features is not None else None
    if parsing is None or (parsing.tool_format is None and parsing.reasoning is None
                           and not parsing.hides_token_metadata):
        return PLAIN_TEXT
    return ToolsAndReasoning(parsing, req.tool_choice)


@dataclass(slots=True)
class ChatEndpoint:
    req: ChatRequest
    features: ChatFeatures | None = None  # None: a plain chat (no tools, reasoning parser or session)
    session: ChatSession | None = None  # a session request (X-Session-ID / session_id, sessions on)
    job: Job = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        req = self.req
        sampling = req.sampling
        if self.features is not None:
            sampling = with_sampling_overrides(sampling, self.features.sampling_overrides)
        self.job = Job("chatcmpl", req.model, sampling, req.output.stream, req.request_id, req.cache_salt,
                       req.priority)

    async def prompt_ids(self, ctx: Upstream, stats: RequestStats) -> list[list[int]]:
        req = self.req
        if self.session is not None and req.prompt_ids is None and req.truncate_prompt_tokens is None:
            return [await self.session.prompt_ids(ctx, req.prompt, stats)]
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
        else:
            ids, stats.prompt_cache_hit, stats.render_s = await ctx.renderer.render_chat(req.prompt)
        if req.truncate_prompt_tokens is not None and len(ids) > req.truncate_prompt_tokens:
            ids = ids[-req.truncate_prompt_tokens:]
        if self.session is not None:
            self.session.unsupported(len(ids))
        return [ids]

    async def formatter(self, ctx: Upstream, meta: ResponseMeta) -> ChatFormatter:
        sampling = self.req.sampling
        # Token names are for logprobs only: a chat that asks for none never builds a namer.
        namer = (TokenNamer(ctx.token_texts, self.req.output.return_tokens_as_token_ids)
                 if sampling.logprobs or sampling.prompt_logprobs is not None else None)
        session = self.session
        formatter = ChatFormatter(self.req, meta, namer, output_parser(self.req, self.features),
                                  session.field() if session is not None else None)
        return session.recorder(formatter, self.req.sampling.n) if session is not None else formatter
