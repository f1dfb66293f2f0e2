"""--workers N: a worker's registry, and the copy of its custom collectors into the multiprocess files.

prometheus-client's multiprocess mode merges only its own metric objects' files; a collector that reads
the process's own state at scrape time (the session store's, LoRA's) is copied into multiprocess metrics
of the same names by CollectorMirror.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics import MetricWrapperBase

log = logging.getLogger(__name__)

MIRROR_INTERVAL_S = 1.0


class WorkerRegistry(CollectorRegistry):
    """A --workers process's registry: its metric objects write multiprocess files; other collectors
    (those that read the process's own state at scrape time, such as the session store's) are kept
    aside for CollectorMirror."""

    def __init__(self):
        super().__init__(auto_describe=True)
        self.custom: list = []

    def register(self, collector) -> None:
        super().register(collector)
        if not isinstance(collector, MetricWrapperBase):
            self.custom.append(collector)


class CollectorMirror:
    """prometheus-client's multiprocess mode merges only its own metric objects' files. With --workers,
    a custom collector's families are copied into multiprocess metrics of the same names (every
    MIRROR_INTERVAL_S, and before a scrape): counters by their increase (summed over workers), gauges
    as the live sum. Another worker's values are at most that interval old."""

    def __init__(self, collectors: list):
        self.collectors = collectors
        self._metrics: dict[tuple[str, str], object] = {}
        self._seen: dict[tuple, float] = {}
        self._lock = threading.Lock()  # the scrape syncs in a thread, the loop on its interval

    def sync(self) -> None:
        with self._lock:
            for collector in list(self.collectors):
                for family in collector.collect():
                    if family.type in ("counter", "gauge") and family.samples:
                        self._copy(family)

    def _copy(self, family) -> None:
        labelnames = tuple(family.samples[0].labels)
        metric = self._metrics.get((family.name, family.type))
        if metric is None:
            if family.type == "counter":
                metric = Counter(family.name, family.documentation, labelnames, registry=None)
            else:
                metric = Gauge(family.name, family.documentation, labelnames, registry=None,
                               multiprocess_mode="livesum")
            self._metrics[(family.name, family.type)] = metric
        for sample in family.samples:
            if tuple(sample.labels) != labelnames or (family.type == "counter" and not sample.name.endswith("_total")):
                continue
            values = tuple(sample.labels.values())
            child = metric.labels(*values) if labelnames else metric
            if family.type == "gauge":
                child.set(sample.value)
                continue
            increase = sample.value - self._seen.get((sample.name, values), 0.0)
            if increase > 0:
                child.inc(increase)
                self._seen[(sample.name, values)] = sample.value




async def mirror_collectors(app: web.Application, mirror: CollectorMirror):
    """--workers: keep this worker's custom collectors' values in the multiprocess files (a cleanup_ctx
    through functools.partial)."""

    async def forever() -> None:
        while True:
            await asyncio.sleep(MIRROR_INTERVAL_S)
            try:
                mirror.sync()
            except Exception:  # a collector's bug must not end the loop
                log.exception("copying a metrics collector into the multiprocess files failed")

    task = asyncio.get_running_loop().create_task(forever())
    yield
    task.cancel()
    mirror.sync()  # the last values, before this worker's files are marked dead
