"""Operating the proxy around the handlers: the middleware chain (observe.py, middleware.py, auth.py,
admission.py, drain.py), the metric series (metrics.py, histograms.py, metrics_mirror.py), SGLang's
/metrics scrape and the `vllm:` view (backend_scrape.py, vllm_metrics.py), GET /metrics (exposition.py),
the access log (access_log.py, log_writer.py) and /openapi.json (openapi.py). Nothing below imports it."""

from token_proxy.faces import door

__all__ = [
    "METRICS", "ProxyMetrics", "add_observability", "configure_logging", "observe_requests",
    "openai_errors",
]

__getattr__ = door(__name__, {
    "METRICS": "metrics",
    "ProxyMetrics": "metrics",
    "add_observability": "observe",
    "configure_logging": "access_log",
    "observe_requests": "observe",
    "openai_errors": "middleware",
})
