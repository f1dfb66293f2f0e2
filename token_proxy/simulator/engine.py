"""The async side of generation: pacing, pause/abort, and turning sequences into replies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson

from token_proxy.simulator.output import final_payload, stream_event
from token_proxy.simulator.sequence import Sequence
from token_proxy.simulator.state import SimState

YIELD_EVERY = 16  # with no simulated latency, let other requests run this often


class ServerCrashed(Exception):
    """The simulated server died while this request was in flight."""


async def run_sequence(seq: Sequence, sim: SimState, warm_prefix: bool = False) -> AsyncIterator[None]:
    """Yield after every token (and at the end); the caller decides what to send.

    A `finally` releases the sequence, so an abandoned or cancelled request
    never stays in `sim.running`.
    """
    try:
        await _wait_admitted(seq, sim)
        if seq.abort_requested:  # aborted while queued: never prefilled
            seq.abort()
            yield
            return
        sim.start(seq, warm_prefix)
        if seq.finished:
            yield
            return
        if sim.config.ttft_s:
            await asyncio.sleep(sim.config.ttft_s)
        async for _ in _decode_loop(seq, sim):
            yield
    finally:
        sim.release(seq)


async def _decode_loop(seq: Sequence, sim: SimState) -> AsyncIterator[None]:
    while True:
        if sim.crashed:
            raise ServerCrashed(seq.rid)
        if sim.blocked is not None:  # the scheduler runs nothing, aborts included (scheduler_block.py)
            await _wait_resumed(seq, sim)
            continue
        if seq.abort_requested:
            seq.abort()
        elif sim.paused:
            await _wait_resumed(seq, sim)
            continue
        else:
            before = len(seq.output_ids)
            seq.step()
            if len(seq.output_ids) > before and sim.config.since("0.5.19"):
                _note_version(seq, sim.weight_version, before)
        yield
        if seq.finished:
            return
        await _pace(seq, sim)


def _note_version(seq: Sequence, version: str, start: int) -> None:
    """0.5.19's scheduler records which weights sampled each output token (meta_info.weight_versions)."""
    if not seq.version_starts or seq.version_starts[-1][0] != version:
        seq.version_starts.append((version, start))


async def _wait_admitted(seq: Sequence, sim: SimState) -> None:
    while (sim.blocked is not None or (not sim.may_admit and not seq.abort_requested)) and not sim.crashed:
        await sim.changed()


async def _wait_resumed(seq: Sequence, sim: SimState) -> None:
    while (sim.blocked is not None or (sim.paused and not seq.abort_requested)) and not sim.crashed:
        await sim.changed()


async def _pace(seq: Sequence, sim: SimState) -> None:
    if sim.config.tpot_s:
        await asyncio.sleep(sim.config.tpot_s)
    elif len(seq.output_ids) % YIELD_EVERY == 0:
        await asyncio.sleep(0)


async def complete(seq: Sequence, sim: SimState, warm_prefix: bool) -> dict:
    """Run to the end; the non-streaming reply for this sequence."""
    async for _ in run_sequence(seq, sim, warm_prefix):
        pass
    return final_payload(seq, sim.weight_version)


async def sse_events(
    seq: Sequence, sim: SimState, with_index: bool, warm_prefix: bool
) -> AsyncIterator[bytes]:
    """`data: {...}` frames, serialized at once so later tokens cannot change a queued event."""
    incremental = sim.config.incremental_streaming_output
    steps = run_sequence(seq, sim, warm_prefix)
    try:
        async for _ in steps:
            if seq.should_emit():
                event = stream_event(seq, sim.weight_version, incremental, with_index)
                yield b"data: " + orjson.dumps(event) + b"\n\n"
    finally:
        await steps.aclose()


async def interleave(streams: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """Merge several sequences' events in the order they are produced (batch / n > 1)."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(stream, queue)) for stream in streams]
    try:
        for _ in tasks:
            while (item := await queue.get()) is not None:
                yield item
        for task in tasks:
            task.result()  # re-raise a producer's failure
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(stream: AsyncIterator[bytes], queue: asyncio.Queue) -> None:
    try:
        async for item in stream:
            queue.put_nowait(item)
    finally:
        queue.put_nowait(None)  # one end marker per producer
