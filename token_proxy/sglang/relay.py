"""The stream reader: a streamed /generate read with protocol callbacks, so SGLang's events reach the
client without a task wake-up per event. Every SGLang stream is read here (http and https alike).

aiohttp's client hands every network read to a StreamReader, wakes the handler's task, which resumes
its generators, translates, and awaits the server's writer: most of a stream's CPU per token. Here the
connection's own `data_received` frames the HTTP response (sglang/http1.py, sans-IO), splits SSE events
(sglang/events.py; what they mean: sglang/replies.py) and passes each read's events to a synchronous
`sink` (translate + write to the client's transport). The handler's task only waits for the end, or for
the client to drain when it reads slower than SGLang writes (then SGLang's connection stops being read:
TCP flow control).

Before `relay` starts (the first batch, read while the response's status is still open), events are
queued for `first`. Every failure is a typed error (sglang/replies.py's for SGLang's answers); time
limits are sglang/deadline.py's. One connection per stream (`Connection: close`, TLS for an https URL):
SGLang closes it after the last chunk.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple
from urllib.parse import urlsplit

from token_proxy.errors import BackendTimeout, BackendUnavailable, ProxyError, ReplyBrokeOff
from token_proxy.sglang.deadline import Deadline
from token_proxy.sglang.events import DONE_EVENT, EventDecoder
from token_proxy.sglang.http1 import FramingError, ResponseFramer
from token_proxy.sglang.replies import error_from_status

Sink = Callable[[list], bool]  # a read's events -> True to stop reading (the proxy ended the output)
_LINGER_S = 2.0  # after a clean end, how long SGLang gets to close first (so no TIME_WAIT here)


class Downstream:
    """Where the relay's writes go; `blocked` pauses reading SGLang until `drained` returns."""

    def blocked(self) -> bool: ...

    async def drained(self) -> None: ...


class Target(NamedTuple):
    host: str
    port: int
    prefix: str  # the URL's path, before /generate
    tls: bool


def relay_target(base_url: str) -> Target:
    """Where an SGLang URL's streams connect; a URL that is not http(s)://host[:port][/prefix] fails here
    (Settings checks the flag's URL at start-up, so this is for URLs learned later)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BackendUnavailable(f"SGLang at {base_url} is unreachable: not an http(s) URL")
    tls = parts.scheme == "https"
    try:
        port = parts.port or (443 if tls else 80)
    except ValueError:
        raise BackendUnavailable(f"SGLang at {base_url} is unreachable: bad port") from None
    return Target(parts.hostname, port, parts.path.rstrip("/"), tls)


class RelayStream(asyncio.Protocol):
    """One streamed POST on its own connection (create with `open_relay`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, base_url: str, coalesce_s: float = 0.0):
        """`coalesce_s` > 0: after each relayed read, SGLang's connection rests unread this long, so what SGLang
        sends meanwhile arrives as one read and leaves as one write (the first batch is never held)."""
        self._loop = loop
        self._base_url = base_url
        self._decoder = EventDecoder()
        self._feed = self._decoder.feed  # bound once: it runs per network read
        self._http = ResponseFramer()
        self.transport: asyncio.Transport | None = None
        self._body = b""  # a non-200 answer's body
        self._queue: list[list[dict]] = []
        self._sink: Sink | None = None
        self._downstream: Downstream | None = None
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None
        self._ended = False
        self._lost = False
        self._paused = False  # the client's backpressure holds SGLang's reads
        self._resting: asyncio.TimerHandle | None = None  # the coalescing pause holds them (its timer)
        self._coalesce_s = coalesce_s
        self._deadline = Deadline(loop, None, None, self._fail)  # no limits until start_timers

    # ------------------------------------------------------------ the handler's side

    async def first(self) -> list[dict] | None:
        """The first batch of events (None: the stream ended without any); the deadline's first-token
        limit fails the stream if it does not come in time."""
        if not self._queue and self._error is None and not self._ended:
            await self._wait()
        if self._queue:
            return self._queue.pop(0)
        if self._error is not None:
            raise self._error
        return None

    async def relay(self, sink: Sink, downstream: Downstream) -> None:
        """Pass every further batch to `sink` as it arrives; returns at the end, raises a stream error."""
        self._sink, self._downstream = sink, downstream
        queued, self._queue = self._queue, []
        for events in queued:  # read before relay began (even if the stream has ended or failed since)
            if sink(events):
                self._end()
                return
        while True:
            if self._error is not None:
                raise self._error
            if self._ended:
                return
            if self._paused:
                await downstream.drained()
                self._paused = False
                if self.transport is not None and not self._lost and self._resting is None:
                    self.transport.resume_reading()
                self._deadline.touch()
                continue
            await self._wait()

    def ending(self) -> None:
        """Every output has finished: what is left (SGLang's [DONE] and end of body) is read at once,
        not after a coalescing pause."""
        self._coalesce_s = 0.0

    async def aclose(self) -> None:
        self._deadline.cancel()
        if self._resting is not None:  # a stream closed mid-pause is not read again
            self._resting.cancel()
        if self.transport is None or self._lost:
            return
        if self._ended and self._error is None:
            # SGLang closes after the last chunk (Connection: close); closing first would leave
            # this side in TIME_WAIT, one per stream.
            self._loop.call_later(_LINGER_S, self.transport.abort)
        else:
            self.transport.close()

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------ timers

    def start_timers(self, first_token_s: float | None, idle_s: float | None, total_s: float | None) -> None:
        """The first-token, idle and total limits (a limit hit fails the stream with its BackendTimeout)."""
        self._deadline.cancel()
        self._deadline = Deadline(self._loop, first_token_s, idle_s, self._fail, total_s)

    # ------------------------------------------------------------ the connection's side

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self._lost = True
        if self._ended or self._error is not None:
            return
        if self._http.ends_at_close():
            try:  # a body delimited by the connection's close
                self._body_end()
            except ProxyError as error:
                self._fail(error)
            return
        self._fail(ReplyBrokeOff(f"SGLang closed the connection mid-response: {exc or 'connection closed'}"))

    def data_received(self, data: bytes) -> None:
        self._deadline.since = self._loop.time()  # Deadline.touch() inlined: once per network read
        if self._ended or self._error is not None:
            return
        try:
            self._received(data)
        except FramingError as exc:
            self._fail(ReplyBrokeOff(f"SGLang closed the connection mid-response: {exc}"))
        except ProxyError as exc:
            self._fail(exc)
        except Exception as exc:  # noqa: BLE001 - the sink's (client's) failure ends this stream, typed
            self._fail(exc)

    def _received(self, data: bytes) -> None:
        http = self._http
        body = http.feed(data)
        if http.status == 200:
            if body:  # one SGLang event per network read lands here
                events, end = self._feed(body)
                if events:
                    self._deliver(events)
                if end is not None:
                    self._stream_end(end)
        elif body:
            self._body += body
        if http.done and not self._ended and self._error is None:
            self._body_end()

    def _stream_end(self, end: object) -> None:
        """What ends the stream, after the events before it: [DONE], or an error (raised)."""
        if end is not DONE_EVENT:
            raise end
        self._end()

    def _body_end(self) -> None:
        if self._http.status != 200:
            self._fail(error_from_status(self._http.status, self._body))
            return
        events, end = self._decoder.close()
        if events:
            self._deliver(events)
        if end is not None and end is not DONE_EVENT:
            raise end
        self._end()

    def _deliver(self, events: list[dict]) -> None:
        if self._ended or self._error is not None:
            return
        sink = self._sink
        if sink is None:
            self._queue.append(events)
            self._deadline.first_done()  # before first() takes it: the limit is met when events are in
            self._wake()
            return
        if sink(events):
            self._end()
            return
        if self._coalesce_s and self._resting is None and not self._paused and not self._lost:
            self.transport.pause_reading()
            self._resting = self._loop.call_later(self._coalesce_s, self._rested)
        if not self._paused and self._downstream.blocked():
            self._paused = True
            self._deadline.pause()  # a slow client is not SGLang's gap
            if self.transport is not None and not self._lost:
                self.transport.pause_reading()
            self._wake()

    def _rested(self) -> None:
        self._resting = None
        if not self._paused and not self._lost and not self._ended and self._error is None:
            self._deadline.touch()  # the pause was the proxy's, not SGLang's silence
            self.transport.resume_reading()

    def _end(self) -> None:
        if not self._ended and self._error is None:
            self._ended = True
            self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._ended or self._error is not None:
            return
        self._error = exc
        self._wake()
        if self.transport is not None and not self._lost:
            self.transport.close()


def cached_resolver(ttl_s: float = 10.0) -> Callable[[str], Awaitable[str]]:
    """host -> an address connect() takes without a lookup, refreshed every `ttl_s` (as aiohttp's
    connector caches DNS): a name would otherwise cost a getaddrinfo in a thread per stream."""
    cache: dict[str, tuple[float, str]] = {}

    async def resolve(host: str) -> str:
        hit = cache.get(host)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return host  # connect() reports it
        cache[host] = (now + ttl_s, infos[0][4][0])
        return infos[0][4][0]

    return resolve


async def open_relay(base_url: str, target: Target, path: str, body: bytes, *, connect_s: float | None,
                     total_s: float | None, idle_s: float | None, first_token_s: float | None,
                     resolve: Callable[[str], Awaitable[str]], coalesce_s: float = 0.0,
                     ssl_context: ssl.SSLContext | None = None, headers: bytes = b"") -> RelayStream:
    """Connect (TLS for an https target: `ssl_context`, or the system's trust store) and send the POST;
    the response is read as it comes (see RelayStream). `headers`: extra header lines, each ending in CRLF."""
    loop = asyncio.get_running_loop()
    stream = RelayStream(loop, base_url, coalesce_s)
    await connect(loop, stream, base_url, target, connect_s, resolve, ssl_context)
    stream.transport.write(_request(target, path, body, headers))
    stream.start_timers(first_token_s, idle_s, total_s)
    return stream


async def connect(loop, protocol: asyncio.Protocol, base_url: str, target: Target, connect_s: float | None,
                  resolve: Callable[[str], Awaitable[str]], ssl_context: ssl.SSLContext | None) -> None:
    """`protocol` connected to `target` (TLS for https: `ssl_context`, or the system's trust store); a
    failure is a typed error (unreachable: 503, too slow: 504). Streams' and whole replies' connections."""
    host, port = target.host, target.port
    tls = (ssl_context or ssl.create_default_context()) if target.tls else None
    try:
        await asyncio.wait_for(loop.create_connection(lambda: protocol, await resolve(host), port, ssl=tls,
                                                      server_hostname=host if tls else None), connect_s)
    except asyncio.TimeoutError:
        raise BackendTimeout("SGLang did not answer in time") from None
    except OSError as exc:  # ssl.SSLError included (a certificate not trusted)
        raise BackendUnavailable(f"SGLang at {base_url} is unreachable: Cannot connect to host {host}:{port} "
                                 f"[{exc.strerror or exc}]") from exc


def host_header(target: Target) -> str:
    """The Host header's value: the port only when it is not the scheme's default."""
    name = f"[{target.host}]" if ":" in target.host else target.host
    return name if target.port == (443 if target.tls else 80) else f"{name}:{target.port}"


def _request(target: Target, path: str, body: bytes, headers: bytes) -> bytes:
    return (b"POST %b%b HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\nContent-Length: %d\r\nConnection: close\r\n%b\r\n%b"
            % (target.prefix.encode(), path.encode(), host_header(target).encode(), len(body), headers, body))
