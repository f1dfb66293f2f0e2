"""Steps 8-9 of the pipeline (ARCHITECTURE.md's numbering): the /generate call to SGLang, streamed or not,
through the output rules.

A client that leaves (or a timeout) aborts the SGLang request: nothing generates for nobody.
"""

from __future__ import annotations

import contextlib
import time

from aiohttp import web

from token_proxy.errors import BackendError, BackendTimeout, ProxyError
from token_proxy.http_io import DONE, SSEWriter, open_sse, sse_frames
from token_proxy.pipeline.fleet_versions import FleetVersions, reply_versions, resend_stale
from token_proxy.pipeline.output_rules import OutputRules
from token_proxy.pipeline.request_state import RequestStats
from token_proxy.pipeline.stream_frames import StreamFrames
from token_proxy.sglang.client import abort_all_of, aborting_on_exit
from token_proxy.sglang.payload import SGLangRequest
from token_proxy.state import ProxyContext
from token_proxy.vocabulary import Output, Reloads


async def generate_whole(ctx: ProxyContext, call: SGLangRequest, rules: OutputRules,
                         stats: RequestStats, lora: Reloads | None = None,
                         fleet: FleetVersions | None = None) -> list[Output]:
    """A non-streaming /generate call -> one finished Output per choice. With `lora` (an adapter
    request), a worker that lost the adapter (it restarted) gets it re-loaded and the call is sent again.
    With `fleet`, a reply on weights the fleet does not serve is sent again (fleet_versions.py)."""
    async with ctx.gate.through(), aborting_on_exit(ctx, call.rids, stats.mark_client_gone):
        stats.mark_sent()
        once = lambda: ctx.client.generate(call.body, lora, call.headers)
        since = time.monotonic()
        items = await once()
        if fleet is not None and not _on_current(items, fleet):
            items = await resend_stale(items, since, once, reply_versions, fleet, ctx.settings.stale_reply_tries,
                                       _nothing, stats.count_stale_reply)
    stats.mark_first_token()
    stats.note_whole_reply(items)
    outputs = rules.whole(items)
    record(stats, rules)
    return outputs


async def generate_streamed(request: web.Request, ctx: ProxyContext, call: SGLangRequest, rules: OutputRules,
                            formatter, stats: RequestStats, lora: Reloads | None = None,
                            fleet: FleetVersions | None = None) -> web.StreamResponse:
    """Errors before SGLang's first event are plain HTTP errors; after it, an error chunk + [DONE].
    With `fleet`, the first event's weight version is checked before any byte reaches the client: a
    stream on weights the fleet does not serve is closed and opened again (fleet_versions.py)."""
    async with ctx.gate.through(), aborting_on_exit(ctx, call.rids, stats.mark_client_gone), \
            contextlib.AsyncExitStack() as stack:
        stats.mark_sent()
        once = lambda: _open_stream(ctx, call, lora, stack)
        since = time.monotonic()
        stream, first = await once()
        if fleet is not None and not _on_current(first or [], fleet):
            stream, first = await resend_stale((stream, first), since, once, _first_versions, fleet,
                                               ctx.settings.stale_reply_tries, _close_stream,
                                               stats.count_stale_reply)
        if first is None:
            raise BackendError("SGLang closed the stream before sending anything")
        frames = StreamFrames(rules, formatter)
        response = await open_sse(request)
        await response.write(frames.start(first))
        stats.mark_first_token()
        try:
            await _relay(request, response, ctx, stream, call.rids, rules, frames, stats)
        except ProxyError as exc:
            if isinstance(exc, BackendTimeout):
                abort_all_of(ctx, call.rids)
            stats.stream_error_status = exc.status
            await response.write(sse_frames([exc.body()]) + DONE)
        finally:
            record(stats, rules)
    return response


def _on_current(items: list[dict], fleet: FleetVersions) -> bool:
    """The fast path of the stale-weights check: every item (or first stream event) carries the fleet's
    current version, or none; anything else is judged by fleet_versions.resend_stale."""
    current = fleet.record.current
    for item in items:
        meta = item.get("meta_info")
        version = meta.get("weight_version") if meta else None
        if version is not None and version != current:
            return False
    return True


async def _nothing(reply) -> None:
    return None


def _first_versions(opened) -> set[str]:
    return reply_versions(opened[1] or [])


async def _close_stream(opened) -> None:
    """A stale stream: closed (SGLang aborts a request whose client left) before it is sent again."""
    await opened[0].aclose()


async def _open_stream(ctx: ProxyContext, call: SGLangRequest, lora: Reloads | None,
                       stack: contextlib.AsyncExitStack):
    """The stream and its first batch of events, through the client's retry point (an HTTP error before it
    raises here)."""
    stream, first = await ctx.client.start_stream(call.body, lora, call.headers)
    stack.push_async_callback(stream.aclose)
    return stream, first


async def _relay(request: web.Request, response: web.StreamResponse, ctx: ProxyContext, stream, rids: list[str],
                 rules: OutputRules, frames: StreamFrames, stats: RequestStats) -> None:
    """Every further event, translated and written as it arrives (from the stream's read callback)."""
    out = SSEWriter(request, response)

    def sink(events: list[dict]) -> bool:
        stats.mark_event()
        data = frames.frames(events)
        if data:
            out.write(data)
        if rules.done:
            stream.ending()  # no coalescing pause before SGLang's end: the client's [DONE] waits on it
        return rules.cut_short and rules.done

    await stream.relay(sink, out)
    if rules.cut_short and rules.done:
        abort_all_of(ctx, rids)  # SGLang would go on to max_tokens
    if not rules.done:
        raise BackendError("SGLang ended the stream before every choice finished")
    await response.write(frames.finish())


def record(stats: RequestStats, rules: OutputRules) -> None:
    stats.completion_tokens = rules.completion_tokens
    stats.cached_tokens = rules.cached_tokens
    stats.weight_version = rules.weight_version
    stats.finish_reasons = rules.finish_reasons
