"""Serving steps every endpoint shares: the model check, one /generate call, a translated stream."""

from __future__ import annotations

import contextlib

from aiohttp import web

from token_proxy.errors import BackendError, BackendTimeout, InvalidRequest, NotFound, ProxyError
from token_proxy.proxy.http_io import DONE, open_sse, sse_frames
from token_proxy.proxy.request_stats import RequestStats, stats_of
from token_proxy.proxy.upstream.aborts import abort_all_of, aborting_on_exit
from token_proxy.proxy.upstream.context import ProxyContext
from token_proxy.schemas.generation import Generation, generations
from token_proxy.schemas.sampling import SamplingRequest
from token_proxy.schemas.sglang_payload import payload_rids


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


def check_seed(ctx: ProxyContext, sampling: SamplingRequest) -> None:
    """vLLM always honours `seed`; SGLang only with --enable-deterministic-inference. A seed that
    would be silently ignored is refused rather than breaking a run's reproducibility unseen."""
    if sampling.seed is None or ctx.backend.honours_seed or ctx.settings.allow_unhonoured_seed:
        return
    raise InvalidRequest(
        "`seed` cannot be honoured: SGLang ignores it unless started with --enable-deterministic-inference "
        "(or run the proxy with --allow-unhonoured-seed true to send it anyway)", param="seed")


def checked_model(ctx: ProxyContext, model: str | None) -> str:
    served = ctx.backend.served_model_name
    if model is not None and model != served:
        raise NotFound(f"The model `{model}` does not exist.", param="model")
    return served


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
            stats.stream_error_status = exc.status
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
