"""The admin plane's side of the metrics: every admin row's error series at 0 from start-up (issue 31),
and the weight version re-read through the admin plane's after-hooks, not by the middleware (issue 29.5)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import token_proxy
from token_proxy.admin import ADMIN
from token_proxy.ops.metrics import ADMIN_STATUSES
from token_proxy.simulator import SIM_STATE

OPS = Path(token_proxy.__file__).resolve().parent / "ops"


async def scrape(client) -> dict[tuple[str, frozenset], float]:
    text = await (await client.get("/metrics")).text()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def requests(endpoint: str, status: str) -> tuple[str, frozenset]:
    return "token_proxy_requests_total", frozenset({"endpoint": endpoint, "status": status, "stream": "false"}.items())


def backend_errors(endpoint: str, kind: str) -> tuple[str, frozenset]:
    return "token_proxy_backend_errors_total", frozenset({"endpoint": endpoint, "kind": kind}.items())


async def test_every_admin_rows_error_series_start_at_zero(proxy):
    samples = await scrape(proxy)
    for endpoint in ("/pause", "/update_weights", "/update_weights_from_disk", "/sleep", "/load_lora_adapter",
                     "/v1/load_lora_adapter", "/init_broadcaster"):
        for status in ("200", "400", "409", "500", "502", "503", "504"):
            assert samples[requests(endpoint, status)] == 0.0, (endpoint, status)
        for kind in ("error", "unavailable", "timeout"):
            assert samples[backend_errors(endpoint, kind)] == 0.0, (endpoint, kind)
    assert ADMIN_STATUSES == ("200", "400", "409", "500", "502", "503", "504")
    # not every route: an ops probe keeps its one 200 series
    assert requests("/health", "503") not in samples and backend_errors("/health", "timeout") not in samples


async def test_an_admin_routes_first_failure_is_an_increase_from_zero(proxy):
    before = await scrape(proxy)
    resp = await proxy.post("/update_weights_from_disk", json={"model_path": 7})
    assert resp.status == 400
    after = await scrape(proxy)
    assert (before[requests("/update_weights_from_disk", "400")], after[requests("/update_weights_from_disk", "400")]) \
        == (0.0, 1.0)


async def test_the_admin_plane_runs_the_weight_version_refresh(sim, proxy):
    plane = proxy.app[ADMIN]
    assert len(plane.after_weights) == 1  # ops/backend_scrape.py's, registered at start-up
    sim.app[SIM_STATE].weight_version = "17"
    plane.record_version(None)  # an update that named no version: the version is read from SGLang
    for _ in range(150):
        samples = await scrape(proxy)
        if samples.get(("token_proxy_weight_version", frozenset())) == 17.0:
            break
        await asyncio.sleep(0.02)
    assert samples[("token_proxy_weight_version", frozenset())] == 17.0
    assert samples[("token_proxy_weight_version_info", frozenset({"weight_version": "17"}.items()))] == 1.0


def test_the_middleware_reads_nothing_from_sglang():
    observe = (OPS / "observe.py").read_text()
    assert "refresh_weight_version" not in observe and "/model_info" not in observe
    assert "async def refresh_weight_version" in (OPS / "backend_scrape.py").read_text()
