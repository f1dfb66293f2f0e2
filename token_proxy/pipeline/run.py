"""The inference pipeline every endpoint runs (chat, chat/tokens, completions, generate):

parse (the endpoint's) -> resolve model -> prompt ids (the endpoint's) -> limits -> SGLang payload
-> call, streamed or not -> output rules (one step for every endpoint) -> format (the endpoint's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from token_proxy.errors import InvalidRequest, NotFound
from token_proxy.http_io import json_response, response_headers
from token_proxy.lora.registry import ADAPTERS, Lease
from token_proxy.lora.workers import LORA
from token_proxy.pipeline.call import generate_streamed, generate_whole
from token_proxy.pipeline.fleet_versions import FLEET_VERSIONS
from token_proxy.pipeline.job import Job
from token_proxy.pipeline.output_rules import Output, OutputRules, ResponseMeta, Usage
from token_proxy.pipeline.request_state import RequestStats, header_request_id, new_request_id, now, stats_of
from token_proxy.sglang.payload import SamplingRequest, resolve_max_tokens, sglang_request
from token_proxy.state import CONTEXT, ProxyContext

GREEDY_BELOW = 1e-6  # SGLang decodes greedily below this temperature
SEED_HONOURED_HEADER = "X-Seed-Honoured"


# ---- step 2: which model serves the request: the base model, or a loaded LoRA adapter

@dataclass(frozen=True, slots=True)
class ModelTarget:
    """The model a request runs on: `name` is what responses report; `lora_path` (when set) goes to
    SGLang as /generate's `lora_path`, selecting a loaded adapter. An adapter request holds a `lease`
    on the adapter version it resolved, so an in-place reload never unloads it under the request."""

    name: str
    lora_path: str | None = None
    lease: Lease | None = None

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


async def resolve_target(app: web.Application, ctx: ProxyContext, requested: str | None) -> ModelTarget:
    """resolve_model; under --workers, a name this worker's adapter mirror does not know yet is looked
    up once more after asking the admin owner for its map (a load through another worker just now)."""
    try:
        return resolve_model(app, ctx, requested)
    except NotFound:
        registry = app.get(ADAPTERS)
        if registry is None or registry.on_miss is None:
            raise
        await registry.on_miss()
        return resolve_model(app, ctx, requested)


def resolve_model(app: web.Application, ctx: ProxyContext, requested: str | None) -> ModelTarget:
    """The request's `model` -> its target. Absent means the served model; otherwise a loaded adapter's
    name, or vLLM's 404 "The model `x` does not exist."."""
    served = ctx.backend.served_model_name
    if requested is None or requested == served or requested in ctx.settings.served_model_aliases:
        return ModelTarget(served)
    registry = app.get(ADAPTERS)
    lease = registry.lease(requested) if registry is not None else None
    if lease is None:
        raise NotFound(f"The model `{requested}` does not exist.", param="model")
    return ModelTarget(requested, lease.lora_path, lease)


# ---- the sequence

class Formatter(Protocol):
    """An endpoint's response shape, over the output rules' `Output`s."""

    # True when a started, unfinished choice's chunk holds only its new text and token ids, and
    # making one changes nothing once the stream's first chunk is out: a plain stream's running
    # chunks are then written from a template (pipeline/stream_frames.py).
    plain_chunks: bool

    def response(self, outputs: list[Output], usage: Usage) -> dict: ...

    def start(self) -> list[dict]: ...

    def chunk(self, out: Output) -> dict | None: ...  # None: nothing to send for this event

    def finish(self, usage: Usage) -> list[dict]: ...


class Endpoint(Protocol):
    """An endpoint's adapter: its parsed request (`job`), its prompt ids and its formatter."""

    job: Job

    async def prompt_ids(self, ctx: ProxyContext, stats: RequestStats) -> list[list[int]]: ...

    async def formatter(self, ctx: ProxyContext, meta: ResponseMeta) -> Formatter: ...


async def run_pipeline(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    ctx, job, stats = request.app[CONTEXT], endpoint.job, stats_of(request)
    stats.stream = job.stream
    target = await resolve_target(request.app, ctx, job.model)
    stats.adapter = target.name if target.lora_path else None
    try:
        return await _serve(request, ctx, endpoint, target, stats)
    finally:
        target.release()


def max_tokens_for(ctx: ProxyContext, sampling: SamplingRequest, ids: list[int]) -> int:
    """The limits step: vLLM's max_tokens rule against this server's context and prompt limits."""
    return resolve_max_tokens(sampling, len(ids), ctx.max_model_len, ctx.backend.max_prompt_len)


def response_id(request: web.Request, job: Job) -> str:
    """The response id, which is also the SGLang rid: the client's request_id or X-Request-Id, prefixed."""
    return new_request_id(job.id_prefix, job.request_id or header_request_id(request))


async def _serve(request: web.Request, ctx: ProxyContext, endpoint: Endpoint, target: ModelTarget,
                 stats: RequestStats) -> web.StreamResponse:
    job = endpoint.job
    sampling = checked_seed(request, ctx, job.sampling)
    prompts = await endpoint.prompt_ids(ctx, stats)
    stats.prompt_tokens = sum(len(ids) for ids in prompts)
    limits = [max_tokens_for(ctx, sampling, ids) for ids in prompts]
    meta = ResponseMeta(response_id(request, job), now(), target.name, prompts)
    stats.backend_rid = meta.response_id
    call = sglang_request(prompts, sampling, limits, rid=meta.response_id, stream=job.stream,
                          cache_salt=job.cache_salt, priority=job.priority, lora_path=target.lora_path,
                          api=ctx.backend.api)
    rules = output_rules(ctx, sampling, len(prompts), stats.prompt_tokens, job.stream)
    formatter = await endpoint.formatter(ctx, meta)
    lora = request.app.get(LORA) if target.lora_path else None
    # The last line against stale weights (fleet_versions.py); --stale-reply-tries 0 turns it off.
    fleet = request.app.get(FLEET_VERSIONS) if ctx.settings.stale_reply_tries else None
    if job.stream:
        return await generate_streamed(request, ctx, call, rules, formatter, stats, lora, fleet)
    outputs = await generate_whole(ctx, call, rules, stats, lora, fleet)
    return json_response(formatter.response(outputs, rules.usage()))


def output_rules(ctx: ProxyContext, sampling: SamplingRequest, prompts: int, prompt_tokens: int,
                 stream: bool) -> OutputRules:
    skip = sampling.skip_special_tokens
    texts = ctx.token_texts
    return OutputRules(sampling, prompts * sampling.n, prompt_tokens, ctx.tokenizer_info.eos_token_id,
                       lambda ids: texts.decode(ids, skip), incremental=not stream or ctx.backend.incremental_stream)


def checked_seed(request: web.Request, ctx: ProxyContext, sampling: SamplingRequest) -> SamplingRequest:
    """vLLM always honours `seed`; SGLang only with --enable-deterministic-inference. Clients written for
    vLLM (SkyRL samples with a seed and temperature > 0) must run unmodified: the seed is sent (as
    sampling_seed) and, when SGLang will ignore it, the request still runs and says so: the response
    header `X-Seed-Honoured: false`, a counter and a warning at most once a minute. With
    --require-honoured-seed it is refused (400 naming `seed`). Under greedy decoding (temperature 0),
    which no engine seeds, a seed is accepted and dropped."""
    if sampling.seed is None or ctx.backend.honours_seed:
        return sampling
    if sampling.temperature is not None and sampling.temperature < GREEDY_BELOW:
        return dataclasses.replace(sampling, seed=None)
    if ctx.settings.require_honoured_seed:
        raise InvalidRequest(
            "`seed` cannot be honoured: SGLang ignores it unless started with --enable-deterministic-inference "
            "(the proxy runs with --require-honoured-seed; greedy requests, temperature 0, may carry a seed)",
            param="seed")
    response_headers(request)[SEED_HONOURED_HEADER] = "false"
    stats_of(request).seed_unhonoured = True  # counted (and warned about) by ops/metrics.py
    return sampling
