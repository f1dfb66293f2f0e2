"""Prometheus view of a SessionStore, read at scrape time (no global collectors).

Wiring: `registry.register(SessionCollector(store))` on the registry the proxy's /metrics serves.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from token_proxy.sessions.store import SessionStore


class SessionCollector:
    def __init__(self, store: SessionStore, prefix: str = "token_proxy_session"):
        self.store = store
        self.prefix = prefix

    def collect(self):
        stats, p = self.store.stats, self.prefix
        yield CounterMetricFamily(f"{p}_hits", "Session requests continued from the stored ids.", value=stats.hits)
        yield CounterMetricFamily(f"{p}_divergent_hits",
                                  "Hits where the template renders the previous turn differently from the "
                                  "model's ids (the ids were kept).", value=stats.divergent_hits)
        fallbacks = CounterMetricFamily(f"{p}_fallbacks", "Session requests rendered in full, by reason.",
                                        labels=["reason"])
        for reason, count in sorted(stats.fallbacks.items()):
            fallbacks.add_metric([reason], count)
        yield fallbacks
        evictions = CounterMetricFamily(f"{p}_evictions", "Sessions dropped, by cause.", labels=["cause"])
        for cause, count in sorted(stats.evictions.items()):
            evictions.add_metric([cause], count)
        yield evictions
        yield CounterMetricFamily(f"{p}_reused_tokens", "Prompt ids taken from stored turns.",
                                  value=stats.reused_tokens)
        yield CounterMetricFamily(f"{p}_tokenized_tokens", "Prompt ids tokenized for session requests.",
                                  value=stats.tokenized_tokens)
        yield GaugeMetricFamily(f"{p}_active", "Sessions held.", value=len(self.store))
        yield GaugeMetricFamily(f"{p}_bytes", "Approximate bytes held by sessions.", value=self.store.nbytes)
