"""vLLM's request-level series as vLLM 0.33 has them (issue 31): every histogram at 0 from start-up,
first-token and per-token times for non-streamed requests too (SGLang's meta_info timestamps), and
vllm:request_prompt_tokens / vllm:request_generation_tokens for every request. Issue 39: the counts agree
as vLLM's do (one per finished choice, vLLM's engine request; a client's abort is not counted), and
inter-token latency is observed per output token, for whole replies too (vLLM 0.33:
vllm/v1/metrics/stats.py IterationStats.update_from_output / update_from_finished_request,
vllm/v1/engine/output_processor.py: abort_requests records no stats)."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from token_proxy.ops import METRICS, ProxyMetrics
from token_proxy.ops.histograms import one_two_five_buckets
from token_proxy.ops.metrics import stream_token_gaps
from token_proxy.pipeline import RequestStats
from token_proxy.state import CONTEXT
from token_proxy.vocabulary import FinishedChoice

MODEL = "sim/qwen2-tiny"
LABELS = frozenset({"model_name": MODEL, "engine": "0"}.items())
USER = [{"role": "user", "content": "Count to ten."}]
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens")


async def scrape(client) -> dict[tuple[str, frozenset], float]:
    text = await (await client.get("/metrics")).text()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def bucket_bounds(samples: dict, name: str) -> list[float]:
    return sorted(float(dict(labels)["le"]) for sample, labels in samples
                  if sample == name + "_bucket" and dict(labels)["le"] != "+Inf"
                  and labels - {("le", dict(labels)["le"])} == LABELS)


async def test_every_vllm_histogram_is_at_zero_from_start_up(proxy):
    samples = await scrape(proxy)
    for name in HISTOGRAMS:
        assert samples[(name + "_count", LABELS)] == 0.0, name
        assert samples[(name + "_sum", LABELS)] == 0.0, name


async def test_prompt_and_generation_token_histograms_have_vllms_buckets_and_count_every_request(proxy):
    max_model_len = proxy.app[CONTEXT].max_model_len
    expected = one_two_five_buckets(max_model_len)
    assert expected[:7] == [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0] and expected[-1] <= max_model_len
    samples = await scrape(proxy)
    assert bucket_bounds(samples, "vllm:request_prompt_tokens") == expected
    assert bucket_bounds(samples, "vllm:request_generation_tokens") == expected

    whole = await proxy.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "ignore_eos": True})
    usage = (await whole.json())["usage"]
    stream = await proxy.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "ignore_eos": True,
                                                            "stream": True})
    await stream.read()
    samples = await scrape(proxy)
    assert samples[("vllm:request_prompt_tokens_count", LABELS)] == 2.0
    assert samples[("vllm:request_prompt_tokens_sum", LABELS)] == 2.0 * usage["prompt_tokens"]
    assert samples[("vllm:request_generation_tokens_count", LABELS)] == 2.0
    assert samples[("vllm:request_generation_tokens_sum", LABELS)] == 7.0


async def test_a_whole_reply_counts_in_ttft_and_tpot_from_sglangs_timestamps(make_sim, make_proxy):
    proxy = await make_proxy(await make_sim(tpot_s=0.02))
    resp = await proxy.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 6, "ignore_eos": True})
    assert resp.status == 200
    samples = await scrape(proxy)
    assert samples[("vllm:time_to_first_token_seconds_count", LABELS)] == 1.0
    assert samples[("vllm:request_time_per_output_token_seconds_count", LABELS)] == 1.0
    tpot = samples[("vllm:request_time_per_output_token_seconds_sum", LABELS)]
    assert 0.015 <= tpot <= 0.2, tpot  # 5 decode steps 20 ms apart, by SGLang's clock
    # one per token after the first, as vLLM observes them for whole replies too (issue 39: streams only)
    assert samples[("vllm:inter_token_latency_seconds_count", LABELS)] == 5.0
    itl = samples[("vllm:inter_token_latency_seconds_sum", LABELS)]
    assert abs(itl - 5 * tpot) < 1e-9, (itl, tpot)
    ttft = samples[("vllm:time_to_first_token_seconds_sum", LABELS)]
    e2e = samples[("vllm:e2e_request_latency_seconds_sum", LABELS)]
    assert 0.0 < ttft < e2e


def test_sglangs_meta_info_timestamps_give_a_whole_replys_times():
    stats = RequestStats()
    stats.note_whole_reply([{"meta_info": {"request_received_ts": 100.0, "prefill_finished_time": 100.25,
                                           "request_finished_ts": 101.0}},
                            {"meta_info": {"request_received_ts": 100.0, "prefill_finished_time": 100.5,
                                           "request_finished_ts": 102.0}}])
    assert (stats.backend_first_token_s, stats.backend_decode_s) == (0.25, 1.5)
    stats.note_whole_reply([{"meta_info": {"prompt_tokens": 3}}, {"text": "x"}])
    assert (stats.backend_first_token_s, stats.backend_decode_s) == (None, None)


def test_a_whole_reply_without_timestamps_is_left_out_of_ttft_and_tpot():
    metrics = ProxyMetrics()
    metrics.start_vllm_series(MODEL, 4096)
    stats = RequestStats(endpoint="/v1/chat/completions", prompt_tokens=9, completion_tokens=4,
                         finished=[FinishedChoice("length", 9, 4)], started_choices=1, started_at=10.0,
                         sent_at=10.001, first_token_at=10.5, finished_at=10.5)
    metrics.observe("/v1/chat/completions", 200, stats, 0.5)
    stats = RequestStats(endpoint="/v1/chat/completions", prompt_tokens=9, completion_tokens=4,
                         finished=[FinishedChoice("stop", 9, 4)], started_choices=1, started_at=20.0,
                         sent_at=20.002, first_token_at=20.5, finished_at=20.5, backend_first_token_s=0.1,
                         backend_decode_s=0.3)
    metrics.observe("/v1/chat/completions", 200, stats, 0.5)
    labels = {"model_name": MODEL, "engine": "0"}
    value = metrics.registry.get_sample_value
    assert value("vllm:e2e_request_latency_seconds_count", labels) == 2.0
    assert value("vllm:time_to_first_token_seconds_count", labels) == 1.0
    assert abs(value("vllm:time_to_first_token_seconds_sum", labels) - 0.102) < 1e-9
    assert value("vllm:request_time_per_output_token_seconds_count", labels) == 1.0
    assert abs(value("vllm:request_time_per_output_token_seconds_sum", labels) - 0.1) < 1e-9
    assert value("vllm:request_prompt_tokens_count", labels) == 2.0
    assert value("vllm:request_generation_tokens_sum", labels) == 8.0
    assert value("vllm:request_prompt_tokens_bucket", {**labels, "le": "5.0"}) == 0.0
    assert value("vllm:request_prompt_tokens_bucket", {**labels, "le": "10.0"}) == 2.0


def test_one_two_five_buckets_as_vllm_builds_them():
    assert one_two_five_buckets(1) == [1.0]
    assert one_two_five_buckets(4096) == [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]
    assert one_two_five_buckets(5000)[-1] == 5000.0


async def test_the_token_histograms_are_the_workers_own_under_workers(proxy):
    assert {"vllm:request_prompt_tokens", "vllm:request_generation_tokens"} <= proxy.app[METRICS].per_request_vllm


def count_of(samples: dict, name: str) -> float:
    return samples[(name + "_count", LABELS)]


async def test_the_request_counts_agree_as_vllms_one_per_finished_choice(make_sim, make_proxy):
    """issue 39: latency 19,408, token histograms 20,517 (aborts included), success 23,425 (per choice). vLLM counts
    each finished engine request (one per choice) once in each; a request its client aborted in none."""
    proxy = await make_proxy(await make_sim(tpot_s=0.01))
    whole = await proxy.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "ignore_eos": True,
                                                           "n": 3, "temperature": 1.0})
    assert whole.status == 200
    prompt = (await whole.json())["usage"]["prompt_tokens"]
    stream = await proxy.post("/v1/completions", json={"prompt": ["a b", "c d e"], "max_tokens": 4, "ignore_eos": True,
                                                       "stream": True})
    assert stream.status == 200
    await stream.read()
    gone = await proxy.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 500, "ignore_eos": True,
                                                          "stream": True})
    await gone.content.readany()
    gone.close()
    for _ in range(100):  # the middleware observes the left request once its handler ends
        samples = await scrape(proxy)
        if samples[("token_proxy_client_disconnects_total", frozenset({"endpoint": "/v1/chat/completions"}.items()))]:
            break
        await asyncio.sleep(0.05)
    success = sum(v for (name, labels), v in samples.items() if name == "vllm:request_success_total"
                  and LABELS <= labels)
    assert success == 5.0  # 3 choices + 2 prompts; the left stream finished no choice
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_time_per_output_token_seconds"):
        assert count_of(samples, name) == success, name
    assert samples[("vllm:request_generation_tokens_sum", LABELS)] == 3 * 3 + 2 * 4
    lengths = [(await (await proxy.post("/tokenize", json={"prompt": p})).json())["count"] for p in ("a b", "c d e")]
    assert lengths[0] != lengths[1]
    # each choice's own prompt: the chat's three choices one prompt each, the two completions prompts their own
    assert samples[("vllm:request_prompt_tokens_sum", LABELS)] == 3 * prompt + sum(lengths)
    # the first token: once per choice that produced one, the left stream's included (vLLM counts it at prefill)
    assert count_of(samples, "vllm:time_to_first_token_seconds") == 6.0


def test_stream_token_gaps_are_one_per_token_after_each_choices_first():
    # one choice: a batch of 1 token is one gap; a batch of 3 tokens after 30 ms is 3 steps of 10 ms
    assert stream_token_gaps([0.02, 0.03], [1, 2, 5], 1) == [0.02, 0.01, 0.01, 0.01]
    # two choices each one token per batch: one step, two observations of the whole gap
    assert stream_token_gaps([0.02], [2, 4], 2) == [0.02, 0.02]
    assert stream_token_gaps([0.02], [2, 2], 2) == []  # a batch with no tokens (a finish event)
