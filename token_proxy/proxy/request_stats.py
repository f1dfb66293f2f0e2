"""What one request did, filled in by handlers and read by whoever reports it (metrics, logs)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web


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
    first_token_at: float | None = None  # perf_counter() when the first output reached the client
    finished_at: float | None = None
    client_disconnected: bool = False
    overloaded: bool = False  # refused by admission (503 + Retry-After, the proxy's own capacity)
    # A stream that failed after its 200 went out: the status its in-stream error chunk carried.
    stream_error_status: int | None = None

    def mark_first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()


STATS = web.RequestKey("stats", RequestStats)


def stats_of(request: web.Request) -> RequestStats:
    """The request's stats, created on first use (middleware may have created them already)."""
    stats = request.get(STATS)
    if stats is None:
        stats = RequestStats(endpoint=request.path)
        request[STATS] = stats
    return stats
