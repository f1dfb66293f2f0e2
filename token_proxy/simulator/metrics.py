"""GET /metrics as SGLang 0.5.17 serves it with --enable-metrics: the same names, types and labels
(multiprocess exposition: labels sorted, counters typed under their _total name), for the series
load-aware clients and the proxy's vllm: view read.

Values come from the simulator's state; a test pins any of them with `set_sglang_metrics`.
"""

from __future__ import annotations

from token_proxy.simulator.info import MAX_TOTAL_NUM_TOKENS, queued
from token_proxy.simulator.state import SimState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help): the scheduler's series (one per TP rank 0 of each DP rank).
SCHEDULER = {
    "sglang:num_running_reqs": ("gauge", "The number of running requests."),
    "sglang:num_queue_reqs": ("gauge", "The number of requests in the waiting queue."),
    "sglang:num_grammar_queue_reqs": ("gauge", "The number of requests in the grammar waiting queue."),
    "sglang:num_paused_reqs": ("gauge", "The number of paused requests by async weight sync."),
    "sglang:num_retracted_reqs": ("gauge", "The number of retracted requests."),
    "sglang:num_used_tokens": ("gauge", "The number of used tokens."),
    "sglang:token_usage": ("gauge", "The token usage."),
    "sglang:gen_throughput": ("gauge", "The generation throughput (token/s)."),
    "sglang:cache_hit_rate": ("gauge", "The prefix cache hit rate."),
    "sglang:max_total_num_tokens": ("gauge", "Maximum total number of tokens in the KV cache pool."),
    # A counter SGLang creates at the first retraction: absent until then (or until a test sets it).
    "sglang:num_retracted_requests_total": ("counter", "Total number of retracted requests."),
}
# The tokenizer manager's series: name -> (type, help, extra label).
TOKENIZER = {
    "sglang:prompt_tokens_total": ("counter", "Number of prefill tokens processed.",
                                   ("is_streaming", "false")),
    "sglang:generation_tokens_total": ("counter", "Number of generation tokens processed.",
                                       ("is_streaming", "false")),
    "sglang:num_requests_total": ("counter", "Number of requests processed.", ("is_streaming", "false")),
    "sglang:cached_tokens_total": ("counter",
                                   "Number of cached prompt tokens by source (device/host/storage).",
                                   ("cache_source", "device")),
    "sglang:num_aborted_requests_total": ("counter", "Number of requests aborted.", None),
}
NAMES = frozenset(SCHEDULER) | frozenset(TOKENIZER)


def set_sglang_metrics(sim: SimState, **values: float) -> None:
    """Pin series to values, by name without the `sglang:` prefix (e.g. token_usage=0.5);
    None unpins one. Unknown names raise, so a typo cannot pass a test silently."""
    for short, value in values.items():
        name = f"sglang:{short}"
        if name not in NAMES:
            raise KeyError(f"the simulator serves no {name}; known: {sorted(NAMES)}")
        if value is None:
            sim.metric_overrides.pop(name, None)
        else:
            sim.metric_overrides[name] = float(value)


def metrics_text(sim: SimState) -> str:
    values = {**_computed(sim), **sim.metric_overrides}
    base = {"engine_type": "unified", "model_name": sim.config.model_name}
    ranks = {**base, "moe_ep_rank": "0", "pp_rank": "0", "tp_rank": "0"}
    lines = []
    for name, (kind, doc) in SCHEDULER.items():
        if name in values:  # retractions: absent until the first one, as in SGLang
            lines += _series(name, kind, doc, ranks, values[name])
    for name, (kind, doc, extra) in TOKENIZER.items():
        lines += _series(name, kind, doc, dict([*base.items(), *([extra] if extra else [])]), values[name])
    return "\n".join(lines) + "\n"


def _series(name: str, kind: str, doc: str, labels: dict[str, str], value: float) -> list[str]:
    """SGLang's multiprocess exposition sorts labels by name."""
    text = ",".join(f'{key}="{_quote(labels[key])}"' for key in sorted(labels))
    return [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{{{text}}} {value!r}"]


def _computed(sim: SimState) -> dict[str, float]:
    running, waiting = queued(sim)
    used = sum(len(s.spec.prompt) + len(s.output_ids) for s in running)
    counters = sim.counters
    return {
        "sglang:num_running_reqs": float(len(running)),
        "sglang:num_queue_reqs": float(len(waiting)),
        "sglang:num_grammar_queue_reqs": 0.0,
        "sglang:num_paused_reqs": 0.0,
        "sglang:num_retracted_reqs": 0.0,
        "sglang:num_used_tokens": float(used),
        "sglang:token_usage": used / MAX_TOTAL_NUM_TOKENS,
        "sglang:gen_throughput": 0.0,
        "sglang:cache_hit_rate": counters.cached_tokens / counters.prompt_tokens if counters.prompt_tokens else 0.0,
        "sglang:max_total_num_tokens": float(MAX_TOTAL_NUM_TOKENS),
        "sglang:prompt_tokens_total": float(counters.prompt_tokens),
        "sglang:generation_tokens_total": float(counters.generation_tokens),
        "sglang:num_requests_total": float(counters.requests),
        "sglang:cached_tokens_total": float(counters.cached_tokens),
        "sglang:num_aborted_requests_total": float(counters.aborted),
    }


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
