"""GET /metrics negotiates through prometheus-client (issue 31): OpenMetrics for
`Accept: application/openmetrics-text`, gzip for `Accept-Encoding: gzip`, text 0.0.4 otherwise; with
--workers N the owner's block joins either format."""

from __future__ import annotations

import gzip

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from token_proxy.ops.exposition import render

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
OWNER_BLOCK = (b"# HELP token_proxy_backend_metrics_scrape_failures_total Reads that failed\n"
               b"# TYPE token_proxy_backend_metrics_scrape_failures_total counter\n"
               b"token_proxy_backend_metrics_scrape_failures_total 4.0\n"
               b"# HELP token_proxy_backend_metrics_scrape_failures_created Reads that failed\n"
               b"# TYPE token_proxy_backend_metrics_scrape_failures_created gauge\n"
               b"token_proxy_backend_metrics_scrape_failures_created 1.7e+09\n"
               b"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
               b"# TYPE vllm:num_requests_running gauge\n"
               b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n')


async def test_plain_scrape_is_text_0_0_4_uncompressed(proxy):
    resp = await proxy.get("/metrics", headers={"Accept-Encoding": "identity"})
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "Content-Encoding" not in resp.headers
    assert "# EOF" not in await resp.text()


async def test_openmetrics_when_asked(proxy):
    resp = await proxy.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0",
                                                "Accept-Encoding": "identity"})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    text = await resp.text()
    assert text.endswith("# EOF\n")
    names = {family.name for family in openmetrics_families(text)}
    assert {"token_proxy_requests", "vllm:request_success", "vllm:time_to_first_token_seconds"} <= names
    # vLLM's names keep their colon on every sample (prometheus-client 0.26 alone would write vllm_...)
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="sim/qwen2-tiny"} 0.0' in text
    assert "vllm_" not in text


async def test_prometheus_3s_accept_header_gets_openmetrics_with_utf8_names(proxy):
    accept = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;"
              "version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;"
              "q=0.3,*/*;q=0.2")
    resp = await proxy.get("/metrics", headers={"Accept": accept, "Accept-Encoding": "gzip"}, auto_decompress=False)
    assert resp.headers["Content-Type"] == ("application/openmetrics-text; version=1.0.0; charset=utf-8; "
                                            "escaping=allow-utf-8")
    text = gzip.decompress(await resp.read()).decode()
    assert "vllm:e2e_request_latency_seconds_count{" in text and text.endswith("# EOF\n")


async def test_gzip_when_accepted(proxy):
    resp = await proxy.get("/metrics", headers={"Accept-Encoding": "gzip"}, auto_decompress=False)
    assert resp.status == 200
    assert resp.headers["Content-Encoding"] == "gzip"
    raw = await resp.read()
    text = gzip.decompress(raw).decode()
    assert "token_proxy_requests_total" in text
    assert len(raw) * 3 < len(text)  # it is the smaller answer the issue asked for


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("token_proxy_requests", "Requests", registry=registry).inc(2)
    return registry


def test_the_owner_block_follows_a_text_page_as_is():
    body, headers = render(_registry(), "", "", OWNER_BLOCK)
    assert headers == {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    assert body.endswith(OWNER_BLOCK)
    values = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert (values["token_proxy_requests_total"], values["vllm:num_requests_running"]) == (2.0, 3.0)


def test_the_owner_block_joins_an_openmetrics_page_before_its_one_eof():
    body, headers = render(_registry(), "application/openmetrics-text", "gzip, deflate", OWNER_BLOCK)
    assert headers["Content-Encoding"] == "gzip"
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    text = gzip.decompress(body).decode()
    assert text.count("# EOF") == 1 and text.endswith("# EOF\n")
    values = {s.name: s.value for f in openmetrics_families(text) for s in f.samples}
    assert (values["token_proxy_requests_total"], values["vllm:num_requests_running"]) == (2.0, 3.0)
    # the owner's counter keeps its _created inside its family (text 0.0.4 wrote it as a gauge of its own)
    assert (values["token_proxy_backend_metrics_scrape_failures_total"],
            values["token_proxy_backend_metrics_scrape_failures_created"]) == (4.0, 1.7e9)


async def test_no_created_samples_unless_the_operator_asks(proxy):
    text = await (await proxy.get("/metrics")).text()
    assert [line for line in text.splitlines() if "_created" in line] == []
    assert "token_proxy_requests_total{" in text
