"""POST /inference/v1/generate: token ids in, token ids out (what prime-rl's renderers client calls)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from aiohttp import web

from token_proxy.api.generate.format import GenerateFormatter
from token_proxy.api.generate.request import GenerateTokensRequest, parse_generate_tokens
from token_proxy.api.logprobs import TokenNamer
from token_proxy.http_io import read_json
from token_proxy.pipeline.job import Job
from token_proxy.pipeline.request_state import RequestStats
from token_proxy.pipeline.run import run_pipeline
from token_proxy.state import Upstream, upstream_of
from token_proxy.vocabulary import ResponseMeta


async def generate_tokens(request: web.Request) -> web.StreamResponse:
    ctx = upstream_of(request.app)
    req = parse_generate_tokens(await read_json(request), ctx.tokenizer_info.vocab_size)
    return await run_pipeline(request, ctx, GenerateEndpoint(req))


@dataclass(slots=True)
class GenerateEndpoint:
    req: GenerateTokensRequest
    job: Job = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.job = Job.of("generate-tokens", self.req, stream=self.req.stream)

    async def prompt_ids(self, ctx: Upstream, stats: RequestStats) -> list[list[int]]:
        return [self.req.token_ids]

    async def formatter(self, ctx: Upstream, meta: ResponseMeta) -> GenerateFormatter:
        return GenerateFormatter(self.req, meta, TokenNamer(ctx.token_texts, as_ids=True))
