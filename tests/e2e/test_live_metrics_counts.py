"""The vllm: request series on a live SGLang (issue 39): one count per finished choice in each, and inter-token
latency per output token after a choice's first, for whole replies too, from SGLang's own meta_info timestamps
(the simulator writes its own; this checks real SGLang sends what the proxy reads).

Run on a GPU host: SGLANG_URL=http://127.0.0.1:30000 pytest tests/e2e/test_live_metrics_counts.py -m gpu
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

USER = [{"role": "user", "content": "Count from one to twenty."}]


async def counts(proxy) -> dict[str, float]:
    text = await (await proxy.get("/metrics")).text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:") and (sample.name.endswith("_count")
                                                    or sample.name == "vllm:request_success_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


async def test_the_vllm_request_counts_agree_per_choice_on_real_sglang(proxy):
    before = await counts(proxy)
    whole = await proxy.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 12, "ignore_eos": True,
                                                           "n": 2, "temperature": 1.0})
    assert whole.status == 200, await whole.text()
    stream = await proxy.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 12, "ignore_eos": True,
                                                            "stream": True})
    assert stream.status == 200
    await stream.read()
    after = await counts(proxy)
    added = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    assert added["vllm:request_success_total"] == 3.0
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:request_prompt_tokens_count",
                 "vllm:request_generation_tokens_count", "vllm:request_time_per_output_token_seconds_count",
                 "vllm:time_to_first_token_seconds_count"):
        assert added[name] == 3.0, (name, added)
    # 11 per whole-reply choice after its first token (SGLang's decode time), and the stream's tokens after its
    # first event batch (11 when that batch held one token)
    assert 22.0 < added["vllm:inter_token_latency_seconds_count"] <= 33.0, added
