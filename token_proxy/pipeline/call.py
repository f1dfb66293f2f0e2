"""Steps 8-9 of the pipeline (ARCHITECTURE.md's numbering): the /generate call to SGLang, streamed or not,
through the output rules.

A client that leaves (or a timeout) aborts the SGLang request: nothing generates for nobody.
"""

from __future__ import annotations

import contextlib

from aiohttp import web

from token_proxy.errors import BackendError, BackendTimeout, ProxyError
from token_proxy.http_io import DONE, SSEWriter, open_sse, sse_frames
from token_proxy.pipeline.output_rules import OutputRules
from token_proxy.pipeline.request_state import RequestStats
from token_proxy.pipeline.stream_frames import StreamFrames
from token_proxy.sglang.client import abort_all_of, aborting_on_exit
from token_proxy.sglang.payload import SGLangRequest
from token_proxy.state import Upstream
from token_proxy.vocabulary import Output


async def generate_whole(ctx: Upstream, call: SGLangRequest, rules: OutputRules,
                         stats: RequestStats) -> list[Output]:
    """A non-streaming /generate call -> one finished Output per choice (what the call allows, a lost
    adapter re-loaded or a reply on stale weights sent again, rides on `call`: sglang/retry_rules.py)."""
    async with ctx.requests.gate.through(), aborting_on_exit(ctx, call.rids, stats.mark_client_gone):
        stats.mark_sent()
        items = await ctx.client.generate(call)
    stats.mark_first_token()
    stats.note_whole_reply(items)
    outputs = rules.whole(items)
    record(stats, rules)
    return outputs


async def generate_streamed(request: web.Request, ctx: Upstream, call: SGLangRequest, rules: OutputRules,
                            formatter, stats: RequestStats) -> web.StreamResponse:
    """Errors before SGLang's first event are plain HTTP errors; after it, an error chunk + [DONE].
    The first event's weight version is checked (`call.check`) before any byte reaches the client."""
    async with ctx.requests.gate.through(), aborting_on_exit(ctx, call.rids, stats.mark_client_gone), \
            contextlib.AsyncExitStack() as stack:
        stats.mark_sent()
        stream, first = await ctx.client.start_stream(call)
        stack.push_async_callback(stream.aclose)
        if first is None:
            raise BackendError("SGLang closed the stream before sending anything")
        frames = StreamFrames(rules, formatter)
        response = await open_sse(request)
        await response.write(frames.start(first))
        stats.mark_first_token()
        stats.event_tokens.append(rules.completion_tokens)
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


async def _relay(request: web.Request, response: web.StreamResponse, ctx: Upstream, stream, rids: list[str],
                 rules: OutputRules, frames: StreamFrames, stats: RequestStats) -> None:
    """Every further event, translated and written as it arrives (from the stream's read callback)."""
    out = SSEWriter(request, response)

    def sink(events: list[dict]) -> bool:
        stats.mark_event()
        data = frames.frames(events)
        stats.event_tokens.append(rules.completion_tokens)
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
    stats.finished = rules.finished
    stats.started_choices = rules.started_choices
