"""GET /metrics: the series table rendered in the format the scraper asks for.

prometheus-client negotiates: `Accept: application/openmetrics-text` gets OpenMetrics, anything else
Prometheus' text format 0.0.4 (exposition.choose_encoder), and `Accept-Encoding: gzip` a gzipped body
(exposition.gzip_accepted). With --workers N the owner's block (serving/metrics_block.py, text 0.0.4)
is appended as is to a text page; for OpenMetrics it is parsed and rendered with the rest, so the page
has one `# EOF`.
"""

from __future__ import annotations

import asyncio
import gzip
from functools import partial

from aiohttp import web
from prometheus_client.exposition import choose_encoder, generate_latest, gzip_accepted
from prometheus_client.openmetrics.exposition import ALLOWUTF8, UNDERSCORES
from prometheus_client.parser import text_string_to_metric_families

from token_proxy.ops.metrics import METRICS

# A --workers process: more exposition text for /metrics (token_proxy/serving/metrics_block.py).
EXTRA_METRICS = web.AppKey("extra_metrics", object)


class _WithBlock:
    """A registry's families, then those of another process's text block. Text 0.0.4 writes a counter's
    or histogram's `_created` samples as a gauge family of their own; OpenMetrics wants them inside
    the family, so they are put back there."""

    def __init__(self, registry, block: bytes):
        self.registry, self.block = registry, block

    def collect(self):
        yield from self.registry.collect()
        families = {family.name: family for family in text_string_to_metric_families(self.block.decode())}
        for name, family in list(families.items()):
            stem = families.get(name.removesuffix("_created")) if name.endswith("_created") else None
            if stem is not None and stem is not family and family.type == "gauge":
                stem.samples.extend(family.samples)
                del families[name]
        yield from families.values()


def render(registry, accept: str, accept_encoding: str, block: bytes = b"") -> tuple[bytes, dict[str, str]]:
    """The body and headers of one scrape (pure: the registry and the request's Accept headers)."""
    encoder, content_type = choose_encoder(accept)
    if isinstance(encoder, partial) and encoder.keywords.get("escaping") == UNDERSCORES:
        # prometheus-client 0.26 escapes sample names by the label-name rule under "underscores" (the
        # default: Prometheus 2 asks for no escaping): vllm:x_total became vllm_x_total under a
        # `# TYPE vllm:x` line. Every name here is a valid legacy metric name, which that escaping leaves
        # as is; allow-utf-8 writes exactly that.
        encoder = partial(encoder.func, **{**encoder.keywords, "escaping": ALLOWUTF8})
    if not block:
        body = encoder(registry)
    elif encoder is generate_latest:  # text 0.0.4: the block's lines simply follow
        body = encoder(registry) + block
    else:
        body = encoder(_WithBlock(registry, block))
    headers = {"Content-Type": content_type}
    if gzip_accepted(accept_encoding):
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    return body, headers


async def metrics_endpoint(request: web.Request) -> web.Response:
    """GET /metrics. Rendering runs in a thread: a big registry takes a millisecond or more, which the
    event loop should not pay."""
    metrics = request.app[METRICS]
    extra = request.app.get(EXTRA_METRICS)
    block = await extra(request.app) if extra is not None else b""  # a --workers process: the owner's block
    accept, encoding = request.headers.get("Accept", ""), request.headers.get("Accept-Encoding", "")
    body, headers = await asyncio.get_running_loop().run_in_executor(
        None, lambda: render(metrics.scrape_registry(), accept, encoding, block))
    return web.Response(body=body, headers=headers)
