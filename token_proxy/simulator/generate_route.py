"""POST /generate: parse, run, reply (JSON, or SSE when "stream" is true)."""

from __future__ import annotations

import asyncio
import time

import orjson
from aiohttp import web

from token_proxy.simulator.engine import YIELD_EVERY, ServerCrashed, complete, interleave, sse_events
from token_proxy.simulator.errors import (
    BadRequest,
    InternalServerError,
    RequestValidationError,
    json_response,
)
from token_proxy.simulator.generate_request import GenerateCall, ModelCrash, parse_generate
from token_proxy.simulator.lora import pool_of, with_adapters
from token_proxy.simulator.sequence import Sequence
from token_proxy.simulator.state import SIM_STATE, SimState

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}


async def generate(request: web.Request) -> web.StreamResponse:
    sim = request.app[SIM_STATE]
    received = time.time()
    body = decode_json_body(await request.read())
    sim.received.append(body)
    stream = isinstance(body, dict) and body.get("stream") is True
    try:
        call = with_adapters(sim.lora, pool_of(sim.config), body, parse_generate(body, sim.config, sim.encode))
    except ModelCrash:
        return _crash(sim)
    except (BadRequest, InternalServerError) as error:
        if stream:
            return await _stream_refusal(request, error)
        raise
    except (TypeError, AttributeError, IndexError, KeyError) as error:  # SGLang lets these escape: a bare 500
        if stream:
            return await _stream_refusal(request, error)
        raise InternalServerError(str(error)) from error
    sequences = sim.admit(call, received)
    if call.stream:
        return await _stream_reply(request, call, sequences, sim)
    return await _json_reply(call, sequences, sim)


def decode_json_body(raw: bytes):
    """FastAPI's json_invalid error, with the position and message orjson reports."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        message = exc.msg.split(":")[0] if exc.msg else "JSON decode error"
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", exc.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": message},
                }
            ]
        ) from exc


def _crash(sim: SimState) -> web.Response:
    # A real server hits a CUDA device-side assert and dies; everything after fails.
    sim.crashed = True
    sim.notify()
    return web.Response(status=500, text="Internal Server Error")


async def _stream_refusal(request: web.Request, error: Exception) -> web.StreamResponse:
    """In a stream SGLang reports a ValueError as an SSE error event under HTTP 200; any
    other exception escapes after the headers went out, so the body is cut short."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    if not isinstance(error, BadRequest):
        request.transport.close()
        return response
    await response.write(b"data: " + orjson.dumps(error.stream_payload()) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _json_reply(call: GenerateCall, sequences: list[Sequence], sim: SimState) -> web.Response:
    warm = _has_parallel_samples(sequences)
    try:
        results = await asyncio.gather(*(complete(s, sim, warm) for s in sequences))
    except ServerCrashed as crash:
        raise InternalServerError("crashed mid-request") from crash
    finally:
        for sequence in sequences:  # a cancelled handler (client gone) aborts what is left
            sim.release(sequence)
    _raise_input_errors(results)
    return json_response(results if call.is_batch else results[0])


def _has_parallel_samples(sequences: list[Sequence]) -> bool:
    return len({s.spec.logical_rid for s in sequences}) < len(sequences)


def _raise_input_errors(results: list[dict]) -> None:
    """The scheduler's own refusals come back as aborts; a non-streaming reply turns them into a 400."""
    for result in results:
        reason = result["meta_info"]["finish_reason"]
        if reason.get("type") == "abort" and reason.get("status_code") == 400:
            raise BadRequest(reason["message"])


async def _stream_reply(
    request: web.Request, call: GenerateCall, sequences: list[Sequence], sim: SimState
) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    warm = _has_parallel_samples(sequences)
    events = interleave([sse_events(s, sim, call.is_batch, warm) for s in sequences])
    try:
        await _write_events(response, events, burst=1 if sim.config.tpot_s else YIELD_EVERY)
    except ServerCrashed:
        request.transport.close()
    except ConnectionResetError:
        pass  # the client left; `finally` aborts what is still running
    finally:
        await events.aclose()
        for sequence in sequences:
            sim.release(sequence)
    return response


async def _write_events(response: web.StreamResponse, events, burst: int) -> None:
    """With no simulated latency tokens come in bursts: one socket write per burst instead of
    per event keeps syscalls from dominating a benchmark (SSE parsers see the same frames)."""
    pending: list[bytes] = []
    async for chunk in events:
        pending.append(chunk)
        if len(pending) >= burst:
            await response.write(b"".join(pending))
            pending.clear()
    await response.write(b"".join(pending) + b"data: [DONE]\n\n")
    await response.write_eof()
