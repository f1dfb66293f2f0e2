"""POST /v1/completions: the completions adapter of the pipeline (text or token-id prompts, one or many)."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from aiohttp import web

from token_proxy.api.completions.format import CompletionFormatter
from token_proxy.api.completions.request import CompletionRequest, parse_completion_request
from token_proxy.api.logprobs import TokenNamer
from token_proxy.http_io import read_json
from token_proxy.pipeline.job import Job
from token_proxy.pipeline.request_state import RequestStats
from token_proxy.pipeline.run import run_pipeline
from token_proxy.state import Upstream, upstream_of
from token_proxy.vocabulary import ResponseMeta


async def completions(request: web.Request) -> web.StreamResponse:
    ctx = upstream_of(request.app)
    req = parse_completion_request(await read_json(request), ctx.tokenizer_info.vocab_size)
    return await run_pipeline(request, ctx, CompletionEndpoint(req))


@dataclass(slots=True)
class CompletionEndpoint:
    req: CompletionRequest
    job: Job = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.job = Job.of("cmpl", self.req, stream=self.req.output.stream)

    async def prompt_ids(self, ctx: Upstream, stats: RequestStats) -> list[list[int]]:
        req = self.req

        async def ids_of(prompt) -> list[int]:
            ids = await ctx.renderer.encode(prompt, req.add_special_tokens) if isinstance(prompt, str) else prompt
            if req.truncate_prompt_tokens is not None and len(ids) > req.truncate_prompt_tokens:
                ids = ids[-req.truncate_prompt_tokens:]
            return ids

        return list(await asyncio.gather(*(ids_of(p) for p in req.prompts)))

    async def formatter(self, ctx: Upstream, meta: ResponseMeta) -> CompletionFormatter:
        namer = TokenNamer(ctx.token_texts, self.req.output.return_tokens_as_token_ids)
        return CompletionFormatter(self.req, meta, namer, await self._prompt_texts(ctx, meta.prompt_ids))

    async def _prompt_texts(self, ctx: Upstream, prompt_ids: list[list[int]]) -> list[str]:
        """Only echo needs the prompt text; token-id prompts are decoded for it."""
        if not self.req.echo:
            return [""] * len(prompt_ids)
        loop = asyncio.get_running_loop()
        return [p if isinstance(p, str) else await loop.run_in_executor(ctx.renderer.executor, ctx.token_texts.decode,
                                                                         ids, False)
                for p, ids in zip(self.req.prompts, prompt_ids)]
