"""Operating the proxy around the handlers: the middleware chain (observe.py, middleware.py, auth.py,
admission.py, drain.py), the metric series (metrics.py, histograms.py, metrics_mirror.py), SGLang's
/metrics scrape and the `vllm:` view (backend_scrape.py, vllm_metrics.py), GET /metrics (exposition.py),
the access log (access_log.py, log_writer.py) and /openapi.json (openapi.py). Nothing below imports it."""

from token_proxy.ops.access_log import configure_logging
from token_proxy.ops.metrics import METRICS, ProxyMetrics
from token_proxy.ops.middleware import openai_errors
from token_proxy.ops.observe import add_observability, observe_requests

__all__ = [
    "METRICS", "ProxyMetrics", "add_observability", "configure_logging", "observe_requests",
    "openai_errors",
]
