"""/metrics with --workers N: the series only one process may produce.

Serving processes count requests, tokens and latencies in prometheus-client's multiprocess files (merged at
every scrape, whichever serving process takes it). These come from the admin owner instead, rendered as one
text block each serving process appends:
- the `vllm:` view and its health (the owner alone reads SGLang's /metrics: one scrape, not N);
- token_proxy_weight_version{,_info} (a label per version must not live in multiprocess files, where
  old label values never disappear);
- token_proxy_lora_adapter_loaded_timestamp_seconds (the owner's registry);
- process_* summed over the supervisor and every serving process, and python_info (prometheus-client's own
  process collector reads one pid, and does not work in multiprocess mode).
"""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.metrics_core import Metric

from token_proxy.ops.metrics import METRICS

log = logging.getLogger(__name__)

# Not token_proxy_lora_adapter_requests_in_flight: the owner's registry counts the serving processes' holds
# (adapter_sync.py), not requests; with --workers N that series is left out.
OWNER_FAMILIES = ("vllm:", "token_proxy_backend_metrics_", "token_proxy_weight_version", "token_proxy_fence",
                  "token_proxy_lora_adapter_loaded_timestamp_seconds", "python_info")
PROCESSES = web.AppKey("serving_processes", list)  # the supervisor's serving process processes (asyncio Process), by index
CONTROL_SESSION = web.AppKey("control_session", aiohttp.ClientSession)
BLOCK_TIMEOUT_S = 2.0


class OwnerFamilies:
    """The owner registry's families that only it produces (not vLLM's per-request ones, which the
    serving processes count)."""

    def __init__(self, metrics):
        self.registry, self.per_worker = metrics.registry, metrics.per_request_vllm

    def collect(self):
        for family in self.registry.collect():
            if family.name.startswith(OWNER_FAMILIES) and family.name not in self.per_worker:
                yield family


class ProcessTreeCollector:
    """process_* as prometheus-client names them, summed over the proxy's processes (start time: the
    earliest; max_fds: the supervisor's)."""

    def __init__(self, pids):
        self.pids = pids  # a callable: the pids now

    def collect(self):
        totals: dict[str, tuple[Metric, dict[str, float]]] = {}
        for pid in self.pids():
            for family in ProcessCollector(pid=lambda p=pid: p, registry=None).collect():
                _, values = totals.setdefault(family.name, (family, {}))
                for sample in family.samples:
                    if sample.name not in values:
                        values[sample.name] = sample.value
                    elif sample.name.endswith("start_time_seconds"):
                        values[sample.name] = min(values[sample.name], sample.value)
                    elif not sample.name.endswith("max_fds"):
                        values[sample.name] += sample.value
        for family, values in totals.values():
            merged = Metric(family.name, family.documentation + " (summed over the proxy's processes)",
                            family.type)
            for name, value in values.items():
                merged.add_sample(name, {}, value)
            yield merged


async def render_owner_block(app: web.Application) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(OwnerFamilies(app[METRICS]))
    processes = app.get(PROCESSES, [])
    registry.register(ProcessTreeCollector(lambda: [os.getpid(), *(proc.pid for proc in processes)]))
    return generate_latest(registry)


async def fetch_owner_block(app: web.Application) -> bytes:
    """A serving process's /metrics: the owner's block, or nothing (logged) when the owner does not answer."""
    try:
        timeout = aiohttp.ClientTimeout(total=BLOCK_TIMEOUT_S)
        async with app[CONTROL_SESSION].get("http://owner/_internal/metrics", timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        log.warning("the admin process's metrics block is missing from this scrape: %s", exc)
        return b""
