"""The inference pipeline every endpoint runs (chat, chat/tokens, completions, generate), and the one
conductor of its steps (ARCHITECTURE.md's numbering):

6 parse (the endpoint's) -> 7 `prepare`: 7a resolve model, 7b seed rule, 7c prompt ids (the endpoint's),
7d limits, 7e response id; then the SGLang payload -> 8 call, streamed or not -> 9 output rules (one step
for every endpoint) -> 10 format (the endpoint's). Render (/v1/chat/completions/render) runs `prepare`
too and stops there.

It imports no feature: a name other than the served model is resolved by the hook a feature registers
on the app at start-up (`MODEL_RESOLVER`; lora/ registers the adapter lookup).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from token_proxy.errors import InvalidRequest, NotFound
from token_proxy.http_io import json_response, response_headers
from token_proxy.pipeline.call import generate_streamed, generate_whole
from token_proxy.pipeline.job import Job
from token_proxy.pipeline.output_rules import OutputRules
from token_proxy.pipeline.reply_check import REPLY_CHECK, StaleCheck, refuse_if_unavailable
from token_proxy.pipeline.request_state import RequestStats, header_request_id, new_request_id, now, stats_of
from token_proxy.sglang.payload import resolve_max_tokens, sglang_request
from token_proxy.state import Upstream
from token_proxy.vocabulary import ModelTarget, Output, ResponseMeta, SamplingRequest, Usage

GREEDY_BELOW = 1e-6  # SGLang decodes greedily below this temperature
SEED_HONOURED_HEADER = "X-Seed-Honoured"


# ---- step 7a: which model serves the request: the served model, or what a registered resolver finds

# The hook for a requested name that is not the served model (nor one of its aliases): its target, or
# vLLM's 404 (NotFound naming `model`). lora/ registers the adapter lookup at start-up; without one,
# only the served model and its aliases exist.
ModelResolver = Callable[[str], Awaitable[ModelTarget]]
MODEL_RESOLVER = web.AppKey("model_resolver", ModelResolver)


def unknown_model(requested: str) -> NotFound:
    return NotFound(f"The model `{requested}` does not exist.", param="model")


async def resolve_target(app: web.Application, ctx: Upstream, requested: str | None) -> ModelTarget:
    """The request's `model` -> its target. Absent means the served model, as do its aliases; any other
    name is the registered resolver's (MODEL_RESOLVER), or vLLM's 404 "The model `x` does not exist."."""
    served = ctx.served_model_name
    if requested is None or requested == served or requested in ctx.settings.served_model_aliases:
        return ModelTarget(served)
    resolver = app.get(MODEL_RESOLVER)
    if resolver is None:
        raise unknown_model(requested)
    return await resolver(requested)


# ---- steps 7a-7e (`prepare`), shared by every endpoint and by render

@dataclass(frozen=True, slots=True)
class Prepared:
    """What `prepare` settled before SGLang is called: the target (release it), the sampling after
    the seed rule, the prompts' ids, each prompt's max_tokens, and the response id (the SGLang rid)."""

    target: ModelTarget
    sampling: SamplingRequest
    prompts: list[list[int]]
    limits: list[int]
    response_id: str


async def prepare(request: web.Request, ctx: Upstream, endpoint: Endpoint, stats: RequestStats) -> Prepared:
    """Resolve the model, apply the seed rule, make the prompt ids, their limits and the response id.
    The caller releases `target` (it is released here if a later step fails)."""
    job = endpoint.job
    target = await resolve_target(request.app, ctx, job.model)
    stats.adapter = target.name if target.lora_path else None
    try:
        sampling = checked_seed(request, ctx, job.sampling)
        prompts = await endpoint.prompt_ids(ctx, stats)
        limits = [max_tokens_for(ctx, sampling, ids) for ids in prompts]
        return Prepared(target, sampling, prompts, limits, response_id(request, job))
    except BaseException:
        target.release()
        raise


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

    async def prompt_ids(self, ctx: Upstream, stats: RequestStats) -> list[list[int]]: ...

    async def formatter(self, ctx: Upstream, meta: ResponseMeta) -> Formatter: ...


async def run_pipeline(request: web.Request, ctx: Upstream, endpoint: Endpoint) -> web.StreamResponse:
    """The sequence, over the `Upstream` the handler took (the request's one look at the app's SGLang)."""
    job, stats = endpoint.job, stats_of(request)
    stats.stream = job.stream
    prepared = await prepare(request, ctx, endpoint, stats)
    target = prepared.target
    try:
        return await _serve(request, ctx, endpoint, prepared, stats)
    finally:
        target.release()


def max_tokens_for(ctx: Upstream, sampling: SamplingRequest, ids: list[int]) -> int:
    """The limits step: vLLM's max_tokens rule against this server's context and prompt limits."""
    backend = ctx.backend
    return resolve_max_tokens(sampling, len(ids), backend.max_model_len, backend.max_prompt_len)


def response_id(request: web.Request, job: Job) -> str:
    """The response id, which is also the SGLang rid: the client's request_id or X-Request-Id, prefixed."""
    return new_request_id(job.id_prefix, job.request_id or header_request_id(request))


async def _serve(request: web.Request, ctx: Upstream, endpoint: Endpoint, prepared: Prepared,
                 stats: RequestStats) -> web.StreamResponse:
    job, target, sampling, prompts = endpoint.job, prepared.target, prepared.sampling, prepared.prompts
    stats.prompt_tokens = sum(len(ids) for ids in prompts)
    limits = prepared.limits
    meta = ResponseMeta(prepared.response_id, now(), target.name, prompts)
    stats.backend_rid = meta.response_id
    # The last line against stale weights (reply_check.py: the hook fleet/ registers); --stale-reply-tries 0
    # turns it off. No healthy worker at all: a prompt 503, never a wait.
    fleet = request.app.get(REPLY_CHECK) if ctx.settings.stale_reply_tries else None
    refuse_if_unavailable(fleet)
    call = sglang_request(prompts, sampling, limits, rid=meta.response_id, stream=job.stream,
                          cache_salt=job.cache_salt, priority=job.priority, lora_path=target.lora_path,
                          api=ctx.backend.api, routing_key=request.headers.get("X-Session-ID"),
                          reload=target.reloads if target.lora_path else None,
                          check=None if fleet is None else
                          StaleCheck(fleet, ctx.settings.stale_reply_tries, stats.count_stale_reply))
    rules = output_rules(ctx, sampling, len(prompts), stats.prompt_tokens, job.stream)
    formatter = await endpoint.formatter(ctx, meta)
    if job.stream:
        return await generate_streamed(request, ctx, call, rules, formatter, stats)
    outputs = await generate_whole(ctx, call, rules, stats)
    return json_response(formatter.response(outputs, rules.usage()))


def output_rules(ctx: Upstream, sampling: SamplingRequest, prompts: int, prompt_tokens: int,
                 stream: bool) -> OutputRules:
    skip = sampling.skip_special_tokens
    texts = ctx.token_texts
    return OutputRules(sampling, prompts * sampling.n, prompt_tokens, ctx.tokenizer_info.eos_token_id,
                       lambda ids: texts.decode(ids, skip), incremental=not stream or ctx.backend.incremental_stream)


def checked_seed(request: web.Request, ctx: Upstream, sampling: SamplingRequest) -> SamplingRequest:
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
