"""The one place that talks HTTP to SGLang.

Every failure becomes a typed error: unreachable -> 503, SGLang's own failure -> 502,
SGLang refusing the request -> 400 with SGLang's message, too slow -> 504.

Every call but a relayed stream (which opens a connection of its own) goes out through `send`, on a
pool whose connections SGLang may close while idle. SGLang's uvicorn closes a keep-alive connection idle for SGLANG_TIMEOUT_KEEP_ALIVE seconds (5 by
default), and under load it acts on that timer late: a request written on the connection in that
window is dropped unread (the client sees "Server disconnected" or ECONNRESET). Two defences:

- the pool drops a connection idle for `--backend-keepalive` seconds (default 4, under SGLang's 5),
  so the proxy never writes on one SGLang is about to close;
- a request whose REUSED connection fails before any byte of the answer is sent once more on a
  fresh connection (a pool-less session): SGLang never read it. A new connection failing, or any
  failure after the status line arrived, is not retried: SGLang may have acted on the request.

aiohttp itself resends an idempotent request (GET, PUT, DELETE) once through the same pool when its
connection fails (uncounted); every /generate and admin POST has only this rule.

This is the transport's retry. `retry_if_lost` (lora/leases.py) is another rule on another
layer: SGLang answered (the adapter is gone) and the proxy re-loads it before sending again.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from contextvars import ContextVar
from typing import Protocol

import aiohttp
import orjson

from token_proxy.errors import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    InvalidRequest,
    ProxyError,
)
from token_proxy.sglang.deadline import Deadline
from token_proxy.sglang.events import DONE_EVENT, EventDecoder
from token_proxy.sglang.relay import (
    Downstream,
    RelayStream,
    cached_resolver,
    open_relay,
    relay_target,
)

log = logging.getLogger(__name__)

_JSON_HEADERS = {"Content-Type": "application/json"}


class SGLangClient:
    def __init__(self, base_url: str, session: aiohttp.ClientSession, request_timeout_s: float,
                 connect_timeout_s: float = 10.0, first_token_timeout_s: float = 0.0,
                 stream_idle_timeout_s: float = 0.0, *, fresh: aiohttp.ClientSession | None = None,
                 on_retry: Callable[[str], None] | None = None, stream_coalesce_s: float = 0.0):
        """Timeouts: total per request; for streams also until the first event and between events
        (0: off). Non-streaming calls get no idle limit: SGLang sends nothing until it is done.
        `stream_coalesce_s`: relayed streams' read pause (sglang/relay.py). `session` is the pool
        (`sglang_sessions`); `fresh` opens a connection per request, for the one retry of a call whose
        reused connection SGLang had closed (`on_retry(reason)`)."""
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._fresh = fresh
        self._on_retry = on_retry
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self._stream_timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s,
                                                     sock_read=stream_idle_timeout_s or None)
        self._first_token_s = first_token_timeout_s or None
        self._coalesce_s = stream_coalesce_s
        self._short = aiohttp.ClientTimeout(total=min(30.0, request_timeout_s), sock_connect=connect_timeout_s)
        self.callback_streams = True  # False: every stream through aiohttp's client (GeneratorStream)
        self._resolve = cached_resolver()

    async def generate(self, payload: dict) -> list[dict]:
        """Non-streaming /generate; always a list of outputs (SGLang answers an object for one)."""
        async with self._post("/generate", payload) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise _error_from_status(resp.status, body)
        data = _loads(body)
        return data if isinstance(data, list) else [data]

    async def open_stream(self, payload: dict) -> RelayStream | GeneratorStream:
        """A streaming /generate, sent; read its first batch with `first()`, the rest with `relay()`,
        then `aclose()` it. Plain-http SGLang is read with protocol callbacks (sglang/relay.py),
        anything else through aiohttp (`generate_stream`)."""
        target = relay_target(self.base_url) if self.callback_streams else None
        if target is None:
            return GeneratorStream(self.generate_stream(payload))
        return await open_relay(self.base_url, target, "/generate", orjson.dumps(payload),
                                connect_s=self._stream_timeout.sock_connect, total_s=self._stream_timeout.total,
                                idle_s=self._stream_timeout.sock_read, first_token_s=self._first_token_s,
                                parse_event=_parse_event, error_from_status=_error_from_status,
                                resolve=self._resolve, coalesce_s=self._coalesce_s)

    async def generate_stream(self, payload: dict) -> AsyncIterator[list[dict]]:
        """Streaming /generate: yields the events that arrived together (one network read), so the
        caller can answer them with one write; an in-stream error raises.

        One generator per stream, reading raw chunks (cumulative SGLang events exceed aiohttp's
        64 KiB line limit on long outputs). The idle limit is aiohttp's sock_read until the headers
        are in, then the stream's Deadline (aiohttp's re-arms a timer on every network read); a limit
        hit fails the body's read with its BackendTimeout."""
        async with self._post("/generate", payload, self._stream_timeout) as resp:
            if resp.status != 200:
                raise _error_from_status(resp.status, await resp.read())
            content = resp.content
            idle_s = self._stream_timeout.sock_read
            protocol = resp.connection.protocol if resp.connection is not None else None
            if idle_s and protocol is not None:
                protocol.read_timeout = None  # its timer, armed by the last read, runs out once more at most
            deadline = Deadline(asyncio.get_running_loop(), self._first_token_s, idle_s, content.set_exception)
            decoder = EventDecoder(_parse_event)
            try:
                while True:
                    deadline.touch()  # a read waits: the idle gap counts from here
                    chunk = await content.readany()
                    deadline.pause()  # the caller works on the events: not SGLang's gap
                    if not chunk:
                        break
                    events, end = decoder.feed(chunk)
                    if events:
                        deadline.first_done()
                        yield events
                    if end is not None:
                        if end is DONE_EVENT:
                            return
                        raise end
                events, end = decoder.close()
                if events:
                    yield events
                if end is not None and end is not DONE_EVENT:
                    raise end
            finally:
                deadline.cancel()

    async def abort(self, rid: str) -> None:
        """Best effort: the request may have finished already (SGLang ignores unknown rids)."""
        try:
            async with await self._send("POST", "/abort_request", data=orjson.dumps({"rid": rid}),
                                        headers=_JSON_HEADERS, timeout=self._short) as resp:
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("abort of %s failed: %s", rid, exc)

    async def get_json(self, path: str, timeout_s: float | None = None):
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else self._short
        try:
            async with await self._send("GET", path, timeout=timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise _error_from_status(resp.status, body)
                return _loads(body)
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(f"SGLang at {self.base_url} is unreachable: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise BackendTimeout(f"SGLang did not answer GET {path} in time") from exc

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        return await self.health_problem(timeout_s) is None

    async def health_problem(self, timeout_s: float = 5.0) -> str | None:
        """None when SGLang's /health answers 200; else what happened, in a few words."""
        try:
            async with await self._send("GET", "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                return None if resp.status == 200 else f"HTTP status {resp.status}"
        except asyncio.TimeoutError:  # first: aiohttp's timeouts are ClientErrors too
            return f"timeout (no answer within {timeout_s:g} s)"
        except aiohttp.ClientConnectorError as exc:
            return _connect_failure(exc)
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}"

    async def metrics_text(self, timeout_s: float) -> str:
        """SGLang's Prometheus page (served only with --enable-metrics: a 404 without it)."""
        try:
            async with await self._send("GET", "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise _error_from_status(resp.status, body)
                return body.decode("utf-8", "replace")
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(f"SGLang at {self.base_url} is unreachable: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise BackendTimeout(f"SGLang did not answer GET /metrics within {timeout_s:g} s") from exc

    def at(self, base_url: str) -> SGLangClient:
        """The same session and timeouts, aimed at another server (one worker behind a router)."""
        return SGLangClient(base_url, self._session, self._timeout.total, self._timeout.sock_connect,
                            fresh=self._fresh, on_retry=self._on_retry, stream_coalesce_s=self._coalesce_s)

    async def call(self, method: str, path: str, body: bytes | None, timeout_s: float,
                   headers: dict | None = None) -> tuple[int, bytes, str]:
        """One bounded control-plane call: (status, raw body, content type). SGLang's own failures
        come back as values (the caller names the worker); unreachable or too slow raise."""
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._timeout.sock_connect)
        headers = _JSON_HEADERS if headers is None and body is not None else headers
        try:
            async with await self._send(method, path, data=body, headers=headers, timeout=timeout) as resp:
                return resp.status, await resp.read(), resp.content_type
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(f"SGLang at {self.base_url} is unreachable: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise BackendTimeout(f"SGLang at {self.base_url} did not answer {method} {path} "
                                 f"within {timeout_s:g} s") from exc

    def open(self, method: str, path_qs: str, body: bytes | None, headers: dict) -> _Call:
        """A raw request whose response the caller streams on (the pass-through of unowned routes)."""
        return _Call(self._send(method, path_qs, data=body, headers=headers, timeout=self._timeout,
                                allow_redirects=False), self.base_url)

    def _post(self, path: str, payload: dict, timeout: aiohttp.ClientTimeout | None = None) -> _Call:
        return _Call(self._send("POST", path, data=orjson.dumps(payload), headers=_JSON_HEADERS,
                                timeout=timeout or self._timeout), self.base_url)

    def _send(self, method: str, path: str, **kwargs):
        """Every HTTP call to SGLang goes out here (streams on the relay open their own connection):
        the response once its headers are in, with the one retry of a closed idle connection (module docstring)."""
        return send(self._session, self._fresh, method, f"{self.base_url}{path}", self._on_retry, **kwargs)


class GeneratorStream:
    """`open_stream`'s answer read through aiohttp's client (the same interface as RelayStream)."""

    def __init__(self, batches: AsyncIterator[list[dict]]):
        self._batches = batches

    async def first(self) -> list[dict] | None:
        return await anext(self._batches, None)

    async def relay(self, sink, downstream: Downstream) -> None:
        async for events in self._batches:
            if sink(events):
                return
            if downstream.blocked():
                await downstream.drained()

    def ending(self) -> None:
        """RelayStream's: nothing to do here (aiohttp reads as data comes)."""

    async def aclose(self) -> None:
        await self._batches.aclose()


class _Call:
    """Wraps a request being sent so connection failures and timeouts surface as typed errors."""

    def __init__(self, sending, base_url: str):
        self._sending = sending  # a coroutine: the response, once its headers are in
        self._resp: aiohttp.ClientResponse | None = None
        self._base_url = base_url

    async def __aenter__(self) -> aiohttp.ClientResponse:
        try:
            self._resp = await self._sending
            return self._resp
        except asyncio.TimeoutError as exc:  # first: aiohttp's ServerTimeoutError is a ClientError too
            raise BackendTimeout("SGLang did not answer in time") from exc
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(f"SGLang at {self._base_url} is unreachable: {exc}") from exc

    async def __aexit__(self, exc_type, exc, tb):
        await self._resp.__aexit__(exc_type, exc, tb)  # released (or closed, when broken)
        if isinstance(exc, ProxyError) or exc is None or isinstance(exc, asyncio.CancelledError):
            return False
        if isinstance(exc, aiohttp.ServerTimeoutError):
            raise BackendTimeout(f"SGLang stalled: no data from it within the idle limit ({exc})") from exc
        if isinstance(exc, asyncio.TimeoutError):
            raise BackendTimeout("SGLang did not finish the request in time") from exc
        if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
            raise BackendUnavailable(f"SGLang closed the connection mid-response: {exc}") from exc
        if isinstance(exc, aiohttp.ClientError):
            raise BackendUnavailable(f"SGLang at {self._base_url} failed: {exc}") from exc
        return False


def _parse_event(raw: bytes) -> tuple[dict | object | None, ProxyError | None]:
    """One raw SSE event -> (the event, or DONE_EVENT, or None: no data) or its error."""
    data = _event_data(raw)
    if data is None:
        return None, None
    if data == b"[DONE]":
        return DONE_EVENT, None
    event = _loads(data)
    return event, _stream_error(event)


def _event_data(event: bytes) -> bytes | None:
    if event.startswith(b"data: ") and b"\n" not in event:  # SGLang's one-line events
        return event[6:]
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def _connect_failure(exc: aiohttp.ClientConnectorError) -> str:
    if isinstance(exc.os_error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"cannot resolve the host ({exc.os_error})"
    return f"cannot connect ({exc.os_error or exc})"


def _loads(body: bytes):
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BackendError(f"SGLang sent invalid JSON: {body[:200]!r}") from exc


def _error_from_status(status: int, body: bytes) -> ProxyError:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    message = _message_of(parsed) or body.decode("utf-8", "replace").strip() or f"HTTP {status}"
    if status == 400:
        return InvalidRequest(f"SGLang rejected the request: {message}")
    if status in (502, 503):
        return BackendUnavailable(f"SGLang is unavailable ({status}): {message}")
    if status == 504:
        return BackendTimeout(f"SGLang timed out: {message}")
    return BackendError(f"SGLang failed with HTTP {status}: {message}")


def _stream_error(event) -> ProxyError | None:
    """An error event, or SGLang's scheduler refusing the request (an abort carrying an HTTP status
    before any token, e.g. an input past max_req_input_len)."""
    if not isinstance(event, dict):
        return BackendError(f"SGLang sent an unexpected stream event: {str(event)[:200]}")
    if "error" in event:
        return _error_from_body(event)
    finish = (event.get("meta_info") or {}).get("finish_reason")
    if not finish:  # every event but the last
        return None
    status = finish.get("status_code") if isinstance(finish, dict) else None
    if finish.get("type") == "abort" and isinstance(status, int) and status >= 400 and not event.get("output_ids"):
        return _error_from_status(status, orjson.dumps({"message": finish.get("message")}))
    return None


def _error_from_body(event: dict) -> ProxyError:
    message = _message_of(event) or "unknown error"
    code = event["error"].get("code") if isinstance(event.get("error"), dict) else None
    if code == 400:
        return InvalidRequest(f"SGLang rejected the request: {message}")
    return BackendError(f"SGLang failed: {message}")


def _message_of(parsed) -> str | None:
    if not isinstance(parsed, dict):
        return None
    error = parsed.get("error")
    if isinstance(error, dict):
        return error.get("message")
    if isinstance(error, str):
        return error
    return parsed.get("message")


# --- calls on behalf of one client request: nothing keeps generating for nobody -----------------

# Why a request ends early: the client went away (cancellation, reset) or SGLang was too slow.
_ABORT_ON = (asyncio.CancelledError, ConnectionResetError, BackendTimeout)


class InFlight(Protocol):
    """What aborting needs of the shared state (ProxyContext has it): the client, the rids being served
    by response id, and a way to run work that outlives a cancelled handler."""

    client: SGLangClient
    in_flight: dict[str, list[str]]

    def spawn(self, coro: Coroutine) -> object: ...


@contextlib.asynccontextmanager
async def aborting_on_exit(ctx: InFlight, rids: list[str], on_client_gone: Callable[[], None] | None = None):
    """Abort the SGLang requests `rids` if the block ends because the client left or time ran out
    (`on_client_gone()` when it was the client: the caller's stats). Meanwhile they are listed in
    `ctx.in_flight` under their response id (an admin abort finds them)."""
    request_id = response_id_of(rids)
    ctx.in_flight[request_id] = rids
    try:
        yield
    except _ABORT_ON as exc:
        log.info("aborting SGLang request %s (%s)", rids, type(exc).__name__)
        if on_client_gone is not None and not isinstance(exc, BackendTimeout):
            on_client_gone()
        abort_all_of(ctx, rids)
        raise
    finally:
        if ctx.in_flight.get(request_id) is rids:  # not a later request reusing the client's id
            del ctx.in_flight[request_id]


def response_id_of(rids: list[str]) -> str:
    """The response id the rids were made from (sglang/payload.py): one rid is the id itself;
    several (n samples, several prompts) are `<id>-<i>[-<j>]`, with items 0 and 1 differing right after
    `<id>-`, so their common prefix is `<id>-`."""
    if len(rids) == 1:
        return rids[0]
    return os.path.commonprefix(rids)[:-1]


def abort_all_of(ctx: InFlight, rids: list[str]) -> None:
    for rid in rids:
        ctx.spawn(ctx.client.abort(rid))


# --- the pool, and the one retry a closed idle connection earns ---------------------------------

RETRY_REASONS = ("disconnected", "reset")  # the metric's label values, created at 0


class _Attempt:
    """Filled in by the connector while a request is being sent: did it get a pooled connection?"""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


_ATTEMPT: ContextVar[_Attempt | None] = ContextVar("sglang_attempt", default=None)


class ReuseAwareConnector(aiohttp.TCPConnector):
    """aiohttp's TCP pool that tells the request in progress (through a context variable, set in the
    sending task) whether the connection it got has carried a request before. Cheaper than a
    TraceConfig, which costs every request a dozen awaited signals."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._used: weakref.WeakSet = weakref.WeakSet()

    async def connect(self, req, traces, timeout):
        conn = await super().connect(req, traces, timeout)
        protocol = conn.protocol
        if protocol is not None:
            attempt = _ATTEMPT.get()
            if attempt is not None:
                attempt.reused = protocol in self._used
            self._used.add(protocol)
        return conn


def stale_reason(exc: BaseException) -> str | None:
    """The retry's reason when `exc` is how a connection the server closed while idle fails before
    the answer: "disconnected" (EOF before the status line) or "reset" (RST on write or read)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "disconnected"
    if isinstance(exc, aiohttp.ClientConnectorError):  # a connect that failed: never a reused connection
        return None
    if isinstance(exc, ConnectionResetError | BrokenPipeError):  # ClientConnectionResetError included
        return "reset"
    if isinstance(exc, aiohttp.ClientOSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE):
        return "reset"
    return None


async def send(pooled: aiohttp.ClientSession, fresh: aiohttp.ClientSession | None, method: str, url: str,
               on_retry: Callable[[str], None] | None = None, **kwargs) -> aiohttp.ClientResponse:
    """`method url` through the pool, until the response's status and headers are in (read or
    release the response). Sent again, once, on a fresh connection when the pooled one was reused
    and failed before any answer (module docstring)."""
    attempt = _Attempt()
    token = _ATTEMPT.set(attempt)
    try:
        return await pooled.request(method, url, **kwargs)
    except aiohttp.ClientError as exc:
        reason = stale_reason(exc) if attempt.reused else None
        if reason is None:
            raise
    finally:
        _ATTEMPT.reset(token)
    if on_retry is not None:
        on_retry(reason)
    return await (fresh or pooled).request(method, url, **kwargs)


@contextlib.asynccontextmanager
async def sglang_sessions(keepalive_s: float) -> AsyncIterator[tuple[aiohttp.ClientSession, aiohttp.ClientSession]]:
    """(pooled, fresh): every SGLang call's pool, idle connections kept `keepalive_s` at most, and a
    session whose every request opens its own connection (the retry's)."""
    # limit=0: the data path must never queue behind aiohttp's default 100-connection pool.
    pooled = aiohttp.ClientSession(connector=ReuseAwareConnector(limit=0, keepalive_timeout=keepalive_s))
    fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
    async with pooled, fresh:
        yield pooled, fresh
