"""The vLLM-named view of SGLang's metrics: values set on the simulator come out under vLLM's names,
and a backend that stops answering withdraws them instead of freezing them."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving.test_metrics import until
from tests.support.golden import golden_file
from token_proxy.ops.vllm_metrics import BackendMetrics, derive, merge_pages, parse_sglang
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.metrics import metrics_text, set_sglang_metrics

FAST = {"backend_metrics_interval_s": 0.02, "backend_metrics_stale_s": 0.25}
VIEW_NAMES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
              "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"}


async def families(client) -> dict:
    text = await (await client.get("/metrics")).text()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(fams: dict, name: str) -> float | None:
    family = fams.get(name)
    return family.samples[0].value if family and family.samples else None


async def test_view_matches_values_set_on_the_simulator(make_sim, make_proxy):
    sim = await make_sim(served_model_name="tiny")
    set_sglang_metrics(sim.app[SIM_STATE], num_running_reqs=3, num_queue_reqs=5, num_grammar_queue_reqs=1,
                       token_usage=0.42, num_retracted_requests_total=7, prompt_tokens_total=1000,
                       generation_tokens_total=250, cached_tokens_total=600)
    proxy = await make_proxy(sim, **FAST)

    async def running_is_three():
        fams = await families(proxy)
        return fams if value(fams, "vllm:num_requests_running") == 3 else None

    fams = await until(running_is_three)
    assert fams, "the vllm: view never showed the simulator's values"
    expected = {"vllm:num_requests_running": ("gauge", 3), "vllm:num_requests_waiting": ("gauge", 6),
                "vllm:kv_cache_usage_perc": ("gauge", 0.42), "vllm:num_preemptions": ("counter", 7),
                "vllm:prompt_tokens": ("counter", 1000), "vllm:generation_tokens": ("counter", 250),
                "vllm:prefix_cache_queries": ("counter", 1000), "vllm:prefix_cache_hits": ("counter", 600)}
    for name, (kind, want) in expected.items():
        family = fams[name]
        assert family.type == kind, name
        (sample,) = family.samples
        assert sample.value == want, name
        assert sample.labels == {"model_name": "tiny", "engine": "0"}
    assert fams["vllm:num_preemptions"].samples[0].name == "vllm:num_preemptions_total"  # vLLM's sample name
    assert value(fams, "token_proxy_backend_metrics_up") == 1
    assert value(fams, "token_proxy_backend_metrics_stale") == 0

    set_sglang_metrics(sim.app[SIM_STATE], num_running_reqs=0, token_usage=0.9)

    async def followed():
        fams = await families(proxy)
        return value(fams, "vllm:num_requests_running") == 0 and value(fams, "vllm:kv_cache_usage_perc") == 0.9

    assert await until(followed)


async def test_a_silent_backend_withdraws_the_view(make_sim, make_proxy):
    sim = await make_sim()
    proxy = await make_proxy(sim, **FAST)

    async def view_present():
        return VIEW_NAMES <= set(await families(proxy))

    assert await until(view_present)
    sim.app[SIM_STATE].crashed = True  # every route answers 503, /metrics included

    async def withdrawn():
        fams = await families(proxy)
        return fams if not (VIEW_NAMES & set(fams)) else None

    fams = await until(withdrawn)
    assert fams, "stale vllm: gauges were still exported"
    assert value(fams, "token_proxy_backend_metrics_up") == 0
    assert value(fams, "token_proxy_backend_metrics_stale") == 1
    assert value(fams, "token_proxy_backend_metrics_scrape_failures") >= 1
    assert value(fams, "token_proxy_backend_metrics_last_success_timestamp_seconds") > 0

    sim.app[SIM_STATE].crashed = False
    assert await until(view_present), "the view did not come back with the backend"


async def test_no_retraction_yet_reads_zero_preemptions(make_sim, make_proxy):
    sim = await make_sim()
    assert "num_retracted_requests_total" not in metrics_text(sim.app[SIM_STATE])  # as in real SGLang
    proxy = await make_proxy(sim, **FAST)

    async def present():
        fams = await families(proxy)
        return fams if "vllm:num_preemptions" in fams else None

    fams = await until(present)
    assert fams and value(fams, "vllm:num_preemptions") == 0


def test_staleness_is_judged_at_scrape_time():
    now = [100.0]
    backend = BackendMetrics("m", stale_after_s=5.0, clock=lambda: now[0])
    assert not {f.name for f in backend.collect()} & VIEW_NAMES  # nothing read yet
    backend.update('sglang:num_running_reqs{tp_rank="0"} 2.0\n')
    assert value({f.name: f for f in backend.collect()}, "vllm:num_requests_running") == 2
    backend.failed()
    now[0] += 5.0
    assert value({f.name: f for f in backend.collect()}, "vllm:num_requests_running") == 2  # within the window
    now[0] += 0.1
    fams = {f.name: f for f in backend.collect()}
    assert not set(fams) & VIEW_NAMES
    assert value(fams, "token_proxy_backend_metrics_stale") == 1


def test_parse_golden_sglang_page():
    page = json.loads(golden_file("throughput.json").read_text())["metrics"]["body_text"]
    values = derive(parse_sglang(page))
    assert values["vllm:prompt_tokens"] == 41554.0 + 192.0  # is_streaming false + true
    assert values["vllm:num_preemptions"] == 0.0  # no retraction: SGLang has not created the counter


def test_ranks_of_one_scheduler_count_once_and_dp_ranks_add_up():
    lines = []
    for dp, running, usage in ((0, 2, 0.25), (1, 3, 0.5)):
        for tp in range(2):  # --enable-metrics-for-all-schedulers: every TP rank repeats its DP rank's value
            labels = f'dp_rank="{dp}",model_name="m",tp_rank="{tp}"'
            lines += [f"sglang:num_running_reqs{{{labels}}} {running}.0", f"sglang:token_usage{{{labels}}} {usage}"]
    values = derive(parse_sglang("\n".join(lines)))
    assert values["vllm:num_requests_running"] == 5
    assert values["vllm:kv_cache_usage_perc"] == 0.5
    assert "vllm:num_requests_waiting" not in values  # a gauge SGLang did not report is not invented


def test_the_pages_of_several_servers_add_up_and_the_fullest_cache_counts():
    """Behind sglang-router every worker's page is read (issue 28): the same labels on two servers are two
    samples, not one."""
    pages = [f'sglang:num_running_reqs{{model_name="m"}} {running}.0\nsglang:token_usage{{model_name="m"}} {usage}\n'
             f'sglang:prompt_tokens_total{{model_name="m"}} {prompt}.0'
             for running, usage, prompt in ((2, 0.25, 10), (3, 0.75, 5))]
    values = derive(merge_pages(pages))
    assert (values["vllm:num_requests_running"], values["vllm:kv_cache_usage_perc"],
            values["vllm:prompt_tokens"]) == (5.0, 0.75, 15.0)
    assert merge_pages(pages[:1]) == parse_sglang(pages[0])


def test_simulator_metrics_use_real_sglang_names_and_labels(tokenizer_dir):
    from token_proxy.simulator import SimConfig, create_sim_app

    golden = json.loads(golden_file("throughput.json").read_text())["metrics"]
    state = create_sim_app(SimConfig(tokenizer_path=str(tokenizer_dir))).get(SIM_STATE)
    fams = list(text_string_to_metric_families(metrics_text(state)))
    sample_names = {s.name for f in fams for s in f.samples}
    assert sample_names <= set(golden["metric_names"])
    golden_fams = {f.name: f for f in text_string_to_metric_families(golden["body_text"])}
    for family in fams:
        if family.name in golden_fams:  # the golden page is cut at 200 lines: compare where it overlaps
            assert family.type == golden_fams[family.name].type
            assert {tuple(sorted(s.labels)) for s in family.samples} <= {
                tuple(sorted(s.labels)) for s in golden_fams[family.name].samples}
    running = next(f for f in fams if f.name == "sglang:num_running_reqs")
    assert running.type == "gauge"
    assert set(running.samples[0].labels) == {"engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank"}
    with pytest.raises(KeyError):
        set_sglang_metrics(state, num_runing_reqs=1)


async def test_cache_config_info_and_waiting_by_reason_for_prime_rl(make_sim, make_proxy):
    """prime-rl reads KV capacity as num_gpu_blocks x block_size from vllm:cache_config_info, and the
    waiting queue by reason."""
    from token_proxy.simulator.info import MAX_TOTAL_NUM_TOKENS

    sim = await make_sim(served_model_name="tiny")
    set_sglang_metrics(sim.app[SIM_STATE], num_queue_reqs=5, num_grammar_queue_reqs=1)
    proxy = await make_proxy(sim, **FAST)

    async def waiting_shown():
        fams = await families(proxy)
        return fams if "vllm:num_requests_waiting_by_reason" in fams else None

    fams = await until(waiting_shown)
    assert fams, "no vllm:num_requests_waiting_by_reason"
    by_reason = {s.labels["reason"]: s.value for s in fams["vllm:num_requests_waiting_by_reason"].samples}
    assert by_reason == {"capacity": 5.0, "deferred": 1.0}
    (info,) = fams["vllm:cache_config_info"].samples
    assert info.value == 1.0
    assert int(info.labels["num_gpu_blocks"]) * int(info.labels["block_size"]) == MAX_TOTAL_NUM_TOKENS
    assert info.labels["block_size"] == "1"
    assert int(info.labels["kv_cache_size_tokens"]) == MAX_TOTAL_NUM_TOKENS  # what prime-rl reads first
