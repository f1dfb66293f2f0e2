"""vLLM 0.33's request-level series on the proxy's /metrics (names, buckets and labels as
vllm/v1/metrics/loggers.py and buckets.py), and labelled series that exist at 0 from start-up."""

from __future__ import annotations

import orjson
from prometheus_client.parser import text_string_to_metric_families

from token_proxy.ops import METRICS
from token_proxy.simulator.testing import stream_events

MODEL = "sim/qwen2-tiny"
LABELS = {"model_name": MODEL, "engine": "0"}
USER = [{"role": "user", "content": "Count to ten."}]
# vLLM 0.33 vllm/v1/metrics/buckets.py, copied here so a drift in either fails.
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]


async def families(client) -> dict:
    resp = await client.get("/metrics")
    return {f.name: f for f in text_string_to_metric_families(await resp.text())}


def samples(family, suffix: str = "") -> dict:
    return {frozenset(s.labels.items()): s.value for s in family.samples if s.name == family.name + suffix}


def buckets(family) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]


def count(family, **labels) -> float:
    return samples(family, "_count").get(frozenset(labels.items()), 0.0)


async def test_vllm_latency_series_have_vllms_names_buckets_and_labels(make_sim, make_proxy):
    proxy = await make_proxy(await make_sim(tpot_s=0.02))  # tokens 20 ms apart: one event batch each
    fams = await families(proxy)
    assert (fams["vllm:time_to_first_token_seconds"].type, buckets(fams["vllm:time_to_first_token_seconds"])) \
        == ("histogram", TTFT)  # at 0 from start-up, as vLLM's
    assert count(fams["vllm:time_to_first_token_seconds"], **LABELS) == 0.0
    success = fams["vllm:request_success"]
    assert success.type == "counter"
    assert samples(success, "_total") == {
        frozenset({**LABELS, "finished_reason": reason}.items()): 0.0
        for reason in ("stop", "length", "abort", "error", "repetition")}

    resp = await proxy.post("/v1/chat/completions", data=orjson.dumps(
        {"messages": USER, "max_tokens": 6, "ignore_eos": True, "stream": True}))
    events = stream_events(await resp.read())
    assert resp.status == 200
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    resp = await proxy.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "ignore_eos": True})
    assert resp.status == 200

    fams = await families(proxy)
    assert buckets(fams["vllm:time_to_first_token_seconds"]) == TTFT
    assert buckets(fams["vllm:inter_token_latency_seconds"]) == ITL
    assert buckets(fams["vllm:request_time_per_output_token_seconds"]) == ITL
    assert buckets(fams["vllm:e2e_request_latency_seconds"]) == LATENCY
    assert samples(fams["vllm:request_success"], "_total")[frozenset({**LABELS, "finished_reason": "length"}.items())] \
        == 2.0
    assert count(fams["vllm:e2e_request_latency_seconds"], **LABELS) == 2.0
    # both: the whole reply's from SGLang's meta_info timestamps (issue 31)
    assert count(fams["vllm:time_to_first_token_seconds"], **LABELS) == 2.0
    assert count(fams["vllm:request_time_per_output_token_seconds"], **LABELS) == 2.0
    # one per output token after the first, as vLLM (issue 39): the stream's 5 gaps between its event batches
    # (6 tokens 20 ms apart) and the whole reply's 3, from SGLang's decode time; all in [0.01, 0.05]
    itl = fams["vllm:inter_token_latency_seconds"]
    assert count(itl, **LABELS) == 8.0
    le = {s.labels["le"]: s.value for s in itl.samples if s.name.endswith("_bucket")}
    assert (le["0.01"], le["0.05"]) == (0.0, 8.0)
    assert "vllm:time_per_output_token_seconds" not in fams  # vLLM 0.33 no longer has it


async def test_labelled_series_start_at_zero(proxy):
    fams = await families(proxy)
    requests = samples(fams["token_proxy_requests"], "_total")

    def req(endpoint, status, stream="false"):
        return requests.get(frozenset({"endpoint": endpoint, "status": status, "stream": stream}.items()))

    assert req("/v1/chat/completions", "503", "true") == 0.0
    assert req("/v1/chat/completions", "503") == 0.0
    assert req("/v1/completions", "400") == 0.0
    assert req("/v1/chat/completions", "499", "true") == 0.0
    assert req("/pause", "200") == 0.0  # an admin route
    assert req("/v1/chat/completions/render", "200") == 0.0
    seeds = samples(fams["token_proxy_unhonoured_seed_requests"], "_total")
    assert seeds[frozenset({"endpoint": "/v1/chat/completions"}.items())] == 0.0
    assert proxy.app[METRICS].model_name == MODEL
