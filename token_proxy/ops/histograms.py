"""Histogram layouts: the proxy's buckets, and vLLM 0.33's (as vllm/v1/metrics/buckets.py and
loggers.py build them)."""

from __future__ import annotations

# Milliseconds to twenty minutes: a cache-hit 1-token reply up to a long stream on a busy server.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80,
                160, 640)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.5, 1, 2.5, 5)
RENDER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# vLLM 0.33's request-level series (vllm/v1/metrics/loggers.py, buckets.py), same names, buckets and
# labels (model_name, engine), for the Grafana boards and prime-rl monitors written for vLLM. vLLM 0.33
# has no vllm:time_per_output_token_seconds any more: its per-request mean is
# vllm:request_time_per_output_token_seconds (on the inter-token buckets).
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
# prime-rl allows 720 s for /update_weights.
WEIGHT_UPDATE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 720, 1800)


def one_two_five_buckets(max_value: int) -> list[float]:
    """vLLM's build_1_2_5_buckets (vllm/v1/metrics/loggers.py): 1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1
