"""The one place that talks HTTP to SGLang: the client, its pool and the one retry point.

Every failure becomes a typed error: unreachable -> 503, SGLang's own failure -> 502, SGLang refusing the
request -> 400 with SGLang's message, too slow -> 504 (what SGLang's answers mean: sglang/replies.py).
A whole /generate reply goes out on the kept-alive pool of the project's own HTTP/1.1 connections
(sglang/pool.py); every other call through `_send` on aiohttp's pool; a stream opens a connection of its
own, read by sglang/relay.py (http or https, alike for all three). Every call carries `--sglang-api-key` as
`Authorization: Bearer <key>` when set, and never a client's credentials.

Both pools drop a connection idle for `--backend-keepalive` seconds (default 4, under SGLang's 5), so the
proxy never writes on one SGLang is about to close; every call goes through the one retry point,
sglang/retry_rules.py's `retrying`, and its one ordered list of rules (broken reply, lost adapter, stale
connection, stale weights).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable, Coroutine
from typing import Protocol

import aiohttp
import orjson
from multidict import CIMultiDict

from token_proxy.errors import BackendTimeout, BackendUnavailable, ProxyError, ReplyBrokeOff
from token_proxy.sglang.payload import SGLangRequest
from token_proxy.sglang.pool import ReplyPool
from token_proxy.sglang.relay import (
    RelayStream,
    Target,
    cached_resolver,
    host_header,
    open_relay,
    relay_target,
)
from token_proxy.sglang.replies import error_from_status, loads, weight_versions
from token_proxy.sglang.retry_rules import ATTEMPT, RETRY_REASONS, Call, retrying

__all__ = ["RETRY_REASONS", "InFlight", "SGLangClient", "abort_all_of", "aborting_on_exit", "response_id_of"]

log = logging.getLogger(__name__)

_JSON_HEADERS = {"Content-Type": "application/json"}


class SGLangClient:
    def __init__(self, base_url: str, session: aiohttp.ClientSession, request_timeout_s: float,
                 connect_timeout_s: float = 10.0, first_token_timeout_s: float = 0.0,
                 stream_idle_timeout_s: float = 0.0, *, fresh: aiohttp.ClientSession | None = None,
                 on_retry: Callable[[str], None] | None = None, stream_coalesce_s: float = 0.0,
                 api_key: str | None = None, ssl_context: ssl.SSLContext | None = None,
                 replies: ReplyPool | None = None):
        """Timeouts: total per request; for streams also until the first event and between events
        (0: off). Non-streaming calls get no idle limit: SGLang sends nothing until it is done.
        `stream_coalesce_s`: streams' read pause (sglang/relay.py). `session` is the pool
        (`sglang_sessions`); `fresh` opens a connection per request, for the one retry of a call whose
        reused connection SGLang had closed (`on_retry(reason)`). `api_key`: SGLang's own --api-key, sent
        on every call. `ssl_context`: for an https URL; None: the system's trust store (SSL_CERT_FILE adds a CA).
        `replies`: the kept-alive pool of whole /generate replies (sglang/pool.py; None: one of the client's own)."""
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._fresh = fresh
        self._on_retry = on_retry
        self._api_key = api_key
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._json_headers = {**_JSON_HEADERS, **self._auth}
        self._ssl = ssl_context if ssl_context is not None or not base_url.startswith("https:") else \
            ssl.create_default_context()
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self._idle_s = stream_idle_timeout_s or None
        self._first_token_s = first_token_timeout_s or None
        self._coalesce_s = stream_coalesce_s
        self._short = aiohttp.ClientTimeout(total=min(30.0, request_timeout_s), sock_connect=connect_timeout_s)
        self._resolve = cached_resolver()
        self._replies = replies if replies is not None else ReplyPool()
        self._target: Target | None = None  # where whole replies go, and their request's head: on first use
        self._head = b""

    async def generate(self, call: SGLangRequest) -> list[dict]:
        """Non-streaming /generate: its outputs, through the retry point with what `call` allows (a lost
        adapter re-loaded, stale weights judged); `call.headers`: extra ones (a session's routing key)."""
        body = orjson.dumps(call.body)
        if self._target is None:
            self._aim()
        request = self._head + _extra_lines(call.headers) + b"Content-Length: %d\r\n\r\n%b" % (len(body), body)

        async def once(again: bool) -> list[dict]:
            status, answer = await self._replies.send(
                self.base_url, self._target, request, new=again, connect_s=self._timeout.sock_connect,
                total_s=self._timeout.total, resolve=self._resolve, ssl_context=self._ssl)
            if status != 200:
                raise error_from_status(status, answer)
            data = loads(answer)
            return data if isinstance(data, list) else [data]  # SGLang answers an object for one output

        return await retrying(once, Call(call.reload, True, call.check), on_retry=self._on_retry,
                              versions_of=weight_versions)

    def _aim(self) -> None:
        """A whole /generate's target and request head, but for its Content-Length and the call's extra headers
        (a URL that is not http(s) fails here, a 503)."""
        target = relay_target(self.base_url)
        self._head = (b"POST %b/generate HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n%b"
                      % (target.prefix.encode(), host_header(target).encode(),
                         b"Authorization: Bearer %b\r\n" % self._api_key.encode() if self._api_key else b""))
        self._target = target

    async def start_stream(self, call: SGLangRequest) -> tuple[RelayStream, list | None]:
        """A streaming /generate and its first batch of events (None: it ended without any); relay the rest
        with `relay()`, then `aclose()` the stream. Retried as `generate`: a stream broken before its first
        event, or whose first event is on stale weights, is closed and opened again (no byte reached the client)."""
        async def once(again: bool) -> tuple[RelayStream, list | None]:
            stream = await self.open_stream(call.body, call.headers)
            try:
                return stream, await stream.first()
            except BaseException:
                await stream.aclose()
                raise

        return await retrying(once, Call(call.reload, True, call.check), on_retry=self._on_retry,
                              versions_of=_first_versions, discard=_close_stream)

    async def open_stream(self, payload: dict, headers: dict | None = None) -> RelayStream:
        """A streaming /generate, sent on a connection of its own (sglang/relay.py)."""
        auth = b"Authorization: Bearer %b\r\n" % self._api_key.encode() if self._api_key else b""
        auth += _extra_lines(headers)
        return await open_relay(self.base_url, relay_target(self.base_url), "/generate", orjson.dumps(payload),
                                connect_s=self._timeout.sock_connect, total_s=self._timeout.total,
                                idle_s=self._idle_s, first_token_s=self._first_token_s, resolve=self._resolve,
                                coalesce_s=self._coalesce_s, ssl_context=self._ssl, headers=auth)

    async def abort(self, rid: str) -> None:
        """Best effort: the request may have finished already (SGLang ignores unknown rids)."""
        try:
            async with await self._send("POST", "/abort_request", data=orjson.dumps({"rid": rid}),
                                        headers=self._json_headers, timeout=self._short) as resp:
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("abort of %s failed: %s", rid, exc)

    async def get_json(self, path: str, timeout_s: float | None = None):
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else self._short
        try:
            async with await self._send("GET", path, timeout=timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise error_from_status(resp.status, body)
                return loads(body)
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(f"SGLang at {self.base_url} is unreachable: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise BackendTimeout(f"SGLang did not answer GET {path} in time") from exc

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
                    raise error_from_status(resp.status, body)
                return body.decode("utf-8", "replace")
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(f"SGLang at {self.base_url} is unreachable: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise BackendTimeout(f"SGLang did not answer GET /metrics within {timeout_s:g} s") from exc

    def at(self, base_url: str) -> SGLangClient:
        """The same session, timeouts, key and TLS, aimed at another server (one worker behind a router)."""
        return SGLangClient(base_url, self._session, self._timeout.total, self._timeout.sock_connect,
                            fresh=self._fresh, on_retry=self._on_retry, stream_coalesce_s=self._coalesce_s,
                            api_key=self._api_key, ssl_context=self._ssl, replies=self._replies)

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

    async def _send(self, method: str, path: str, headers: dict | None = None, **kwargs) -> aiohttp.ClientResponse:
        """Every HTTP call to SGLang but /generate goes out here: the response once its headers are in,
        with the one retry of a closed idle connection (sglang/retry_rules.py). The key replaces any Authorization."""
        if self._auth:
            headers = CIMultiDict(headers or {})  # a copy that keeps repeated headers
            headers.update(self._auth)
        url = f"{self.base_url}{path}"

        def once(again: bool):
            session = self._fresh if again and self._fresh is not None else self._session
            return _request(session, method, url, headers=headers, ssl=self._ssl_arg(), **kwargs)

        return await retrying(once, on_retry=self._on_retry)

    def _ssl_arg(self) -> ssl.SSLContext | bool:
        return self._ssl if self._ssl is not None else True  # True: aiohttp's default (an http URL ignores it)


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
            raise ReplyBrokeOff(f"SGLang closed the connection mid-response: {exc}") from exc
        if isinstance(exc, aiohttp.ClientError):
            raise BackendUnavailable(f"SGLang at {self._base_url} failed: {exc}") from exc
        return False


def _connect_failure(exc: aiohttp.ClientConnectorError) -> str:
    if isinstance(exc.os_error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"cannot resolve the host ({exc.os_error})"
    return f"cannot connect ({exc.os_error or exc})"


# --- calls on behalf of one client request: nothing keeps generating for nobody -----------------

# Why a request ends early: the client went away (cancellation, reset) or SGLang was too slow.
_ABORT_ON = (asyncio.CancelledError, ConnectionResetError, BackendTimeout)


class InFlight(Protocol):
    """What aborting needs of the shared state (ProxyContext has it): the client, the rids being served
    by response id, and a way to run work that outlives a cancelled handler."""

    client: SGLangClient
    in_flight: dict[str, list[str]]

    def spawn(self, coro: Coroutine) -> object: ...


class aborting_on_exit:  # noqa: N801 - used as a function: `async with aborting_on_exit(...)`
    """Abort the SGLang requests `rids` if the block ends because the client left or time ran out
    (`on_client_gone()` when it was the client: the caller's stats). Meanwhile they are listed in
    `ctx.in_flight` under their response id (an admin abort finds them). A slotted class, not an
    asynccontextmanager, which costs every generation ~3 us more."""

    __slots__ = ("_ctx", "_on_client_gone", "_request_id", "_rids")

    def __init__(self, ctx: InFlight, rids: list[str], on_client_gone: Callable[[], None] | None = None) -> None:
        self._ctx, self._rids, self._on_client_gone = ctx, rids, on_client_gone
        self._request_id = response_id_of(rids)

    async def __aenter__(self) -> None:
        self._ctx.in_flight[self._request_id] = self._rids

    async def __aexit__(self, exc_type, exc, tb) -> None:
        ctx, rids, request_id = self._ctx, self._rids, self._request_id
        try:
            if exc is not None and isinstance(exc, _ABORT_ON):
                log.info("aborting SGLang request %s (%s)", rids, type(exc).__name__)
                if self._on_client_gone is not None and not isinstance(exc, BackendTimeout):
                    self._on_client_gone()
                abort_all_of(ctx, rids)
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


async def _request(session: aiohttp.ClientSession, method: str, url: str, **kwargs) -> aiohttp.ClientResponse:
    """One HTTP request, until its status and headers are in (the retry point's attempt notes that the answer began)."""
    resp = await session.request(method, url, **kwargs)
    attempt = ATTEMPT.get()
    if attempt is not None:
        attempt.answered = True
    return resp


def _first_versions(opened: tuple[RelayStream, list | None]) -> set[str]:
    return weight_versions(opened[1] or [])


async def _close_stream(opened: tuple[RelayStream, list | None]) -> None:
    """A stale stream: closed (SGLang aborts a request whose client left) before it is opened again."""
    await opened[0].aclose()


def _extra_lines(headers: dict | None) -> bytes:
    """A call's extra headers (a routing key) as header lines, each ending in CRLF."""
    if not headers:
        return b""
    return b"".join(b"%b: %b\r\n" % (k.encode(), v.encode()) for k, v in headers.items())
