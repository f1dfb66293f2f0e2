"""One request's own state: its ids (the client's, or new ones), the clock that stamps responses, and
what it did (RequestStats: filled in by handlers, read by whoever reports it: metrics, logs)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from aiohttp import web

from token_proxy.ids import MAX_ID_CHARS
from token_proxy.vocabulary import FinishedChoice


def new_request_id(prefix: str, client_id: str | None) -> str:
    return f"{prefix}-{client_id or random_uuid()}"


def random_uuid() -> str:
    """`uuid.uuid4().hex` (vLLM's random_uuid: 32 hex digits, version 4, RFC 4122 variant) in ~40 % of its
    time: uuid4 builds a UUID object (an int, its version bits, a frozen setattr) only to print it."""
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40
    raw[8] = raw[8] & 0x3F | 0x80
    return raw.hex()


def header_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id when usable as an SGLang rid and a response header: printable
    (no control characters, no undecodable bytes) and at most MAX_ID_CHARS characters (token_proxy/ids.py)."""
    given = (request.headers.get("X-Request-Id") or "").strip()[:MAX_ID_CHARS]
    return given if given and given.isprintable() else None


def now() -> int:
    return int(time.time())


@dataclass(slots=True)
class RequestStats:
    endpoint: str = ""
    stream: bool = False
    backend_rid: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    adapter: str | None = None  # the LoRA adapter's name, for an adapter request
    prompt_cache_hit: bool | None = None  # None: no chat rendering in this request
    render_s: float = 0.0  # rendering + tokenizing, when it ran (cache misses)
    started_at: float = field(default_factory=time.perf_counter)
    sent_at: float | None = None  # perf_counter() when the /generate call to SGLang was sent
    first_token_at: float | None = None  # perf_counter() when the first output reached the client
    finished_at: float | None = None
    # A stream's gaps between SGLang's event batches after the first, the output tokens so far after each
    # batch (the first included: one more entry than gaps), and the time of the last batch
    # (vllm:inter_token_latency_seconds: vLLM observes one gap per engine step, one token per choice).
    event_gaps: list[float] = field(default_factory=list)
    event_tokens: list[int] = field(default_factory=list)
    last_event_at: float | None = None
    finished: list[FinishedChoice] = field(default_factory=list)  # one per choice SGLang finished
    started_choices: int = 0  # choices that produced output (vLLM's first-token count)
    client_disconnected: bool = False
    overloaded: bool = False  # refused by admission (503 + Retry-After, the proxy's own capacity)
    # A stream that failed after its 200 went out: the status its in-stream error chunk carried.
    stream_error_status: int | None = None
    seed_unhonoured: bool = False  # the request's seed went to an SGLang that ignores it
    stale_replies: int = 0  # replies on weights the fleet does not serve, sent again (pipeline/reply_check.py)
    # A whole reply's times by SGLang's clock (meta_info), for vLLM's first-token and per-token series:
    # request_received_ts -> prefill_finished_time, and prefill_finished_time -> request_finished_ts.
    backend_first_token_s: float | None = None
    backend_decode_s: float | None = None

    def mark_sent(self) -> None:
        if self.sent_at is None:
            self.sent_at = time.perf_counter()

    def mark_first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = self.last_event_at = time.perf_counter()

    def count_stale_reply(self) -> None:
        self.stale_replies += 1

    def note_whole_reply(self, items: list) -> None:
        """SGLang's meta_info timestamps of a non-streamed reply (one item per choice; the first to
        finish prefill, the last to finish decoding). Left None when SGLang sends none."""
        firsts, decodes = [], []
        for item in items:
            meta = item.get("meta_info") if isinstance(item, dict) else None
            received, prefilled, finished = (meta.get(key) if isinstance(meta, dict) else None for key in
                                             ("request_received_ts", "prefill_finished_time", "request_finished_ts"))
            if isinstance(received, (int, float)) and isinstance(prefilled, (int, float)) and prefilled >= received:
                firsts.append(prefilled - received)
                if isinstance(finished, (int, float)) and finished >= prefilled:
                    decodes.append(finished - prefilled)
        self.backend_first_token_s = min(firsts) if firsts else None
        self.backend_decode_s = max(decodes) if decodes else None

    def mark_client_gone(self) -> None:
        self.client_disconnected = True

    def mark_event(self) -> None:
        """One batch of stream events arrived: one perf_counter and one append per batch, not per token."""
        at = time.perf_counter()
        if self.last_event_at is not None:
            self.event_gaps.append(at - self.last_event_at)
        self.last_event_at = at


STATS = web.RequestKey("stats", RequestStats)


REQUEST_ID = web.RequestKey("request_id", str)


def request_id_of(request: web.Request) -> str:
    """The id the client sees in X-Request-Id and the log line shows: the rid SGLang was given
    when there was one, else the client's own X-Request-Id, else a fresh one. Fixed on first use,
    so the header (sent when the response starts) and the log line (after it ends) agree."""
    rid = request.get(REQUEST_ID)
    if rid is None:
        stats = request.get(STATS)
        rid = (stats.backend_rid if stats is not None else None) or header_request_id(request) or random_uuid()
        request[REQUEST_ID] = rid
    return rid


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: runs before the headers go out, streams included (here, not in ops/, so a
    stream that opens its response inside the handler runs no ops/ code)."""
    response.headers["X-Request-Id"] = request_id_of(request)


def stats_of(request: web.Request) -> RequestStats:
    """The request's stats, created on first use (middleware may have created them already)."""
    stats = request.get(STATS)
    if stats is None:
        stats = RequestStats(endpoint=request.path)
        request[STATS] = stats
    return stats
