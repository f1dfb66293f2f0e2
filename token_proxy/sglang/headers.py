"""Which of a client's request headers may go upstream to SGLang: an allow-list (pure).

A deny-list leaks every credential it does not name (Cookie, Api-Key, X-Auth-Token, ...): only the headers
SGLang reads, and the generic ones a body needs, pass. Read from SGLang 0.5.17..0.5.23's source: the body's
Content-Type and Accept; tracing (observability/trace.py's TRACE_HEADERS, and W3C baggage); routing
(serving_base.py: x-data-parallel-rank, x-smg-routing-key); the per-request overrides
(entrypoints/request_headers.py: x-override-*) and opt-ins (serving_chat.py: x-sglext-*); the tokenizer
metrics' labels (--tokenizer-metrics-custom-labels-header, "x-custom-labels" by default). SGLang's own key
is --sglang-api-key, which the client (sglang/client.py) adds to every call.
"""

from __future__ import annotations

from collections.abc import Iterable

from multidict import CIMultiDict

ALLOWED = frozenset({
    "content-type", "accept", "user-agent", "x-request-id",
    "traceparent", "tracestate", "baggage",
    "x-data-parallel-rank", "x-smg-routing-key", "x-custom-labels",
})
ALLOWED_PREFIXES = ("x-override-", "x-sglext-")


def upstream_headers(headers: Iterable[tuple[str, str]]) -> CIMultiDict:
    """The client's headers that SGLang may see, in their order; every other header stays here."""
    return CIMultiDict((name, value) for name, value in headers if allowed(name))


def allowed(name: str) -> bool:
    lower = name.lower()
    return lower in ALLOWED or lower.startswith(ALLOWED_PREFIXES)
