"""sglang/discovery.py over simulators named with --worker (no router process): every worker is read,
one that is down is left out and named, a single SGLang is a fleet of one."""

from __future__ import annotations

import logging

from tests.support.admin_fixtures import free_port
from token_proxy.state import CONTEXT


def url_of(sim) -> str:
    return str(sim.make_url("")).rstrip("/")


async def test_a_single_sglang_is_read_at_its_own_url(make_sim, make_proxy):
    sim = await make_sim(sglang_version="0.5.21", incremental_streaming_output=True, context_length=2048)
    picture = (await make_proxy(sim)).app[CONTEXT].picture
    assert (picture.behind_router, picture.worker_urls) == (False, [url_of(sim)])
    agreed = picture.agreed
    assert (agreed.api.version, agreed.incremental_stream, agreed.max_model_len, agreed.metrics_enabled) == (
        "0.5.21", True, 2048, True)
    assert picture.workers[url_of(sim)] == agreed


async def test_every_worker_flag_is_read_and_the_smallest_context_is_agreed(make_sim, make_proxy, caplog):
    caplog.set_level(logging.INFO, logger="token_proxy.sglang.discovery")
    a, b = await make_sim(context_length=4096), await make_sim(context_length=1024)
    proxy = await make_proxy(a, workers=(url_of(a), url_of(b)))
    picture = proxy.app[CONTEXT].picture
    assert picture.behind_router is True
    assert {url: w.max_model_len for url, w in picture.workers.items()} == {url_of(a): 4096, url_of(b): 1024}
    assert proxy.app[CONTEXT].max_model_len == 1024
    assert [r.getMessage() for r in caplog.records if "differs" in r.getMessage()] == [
        f"SGLang worker {url_of(b)} differs in context length: 1024, where {url_of(a)} has 4096; the smallest is used"]
    models = await (await proxy.get("/v1/models")).json()
    assert models["data"][0]["max_model_len"] == 1024


async def test_a_worker_that_is_down_is_left_out_and_named(make_sim, make_proxy, caplog):
    caplog.set_level(logging.INFO, logger="token_proxy.sglang.discovery")
    sim, down = await make_sim(), f"http://127.0.0.1:{free_port()}"
    proxy = await make_proxy(sim, workers=(url_of(sim), down))
    assert proxy.app[CONTEXT].picture.worker_urls == [url_of(sim)]
    (line,) = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert line.startswith(f"SGLang worker {down} is left out of the proxy's picture of SGLang: SGLang at {down} "
                           "is unreachable")
    assert (await proxy.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status == 200
