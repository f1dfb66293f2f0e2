"""The inference pipeline, the one conductor of a request's steps (ARCHITECTURE.md's numbering):
`prepare` and `run_pipeline` (run.py), the SGLang call (call.py), the output rules (output_rules.py),
the stream's frames (stream_frames.py), per-request stats (request_state.py), the parsed request
(job.py) and the reply-check hook a feature registers (reply_check.py: fleet/ does). The values it hands the endpoints
(`ModelTarget`, `Output`, `Usage`, `ResponseMeta`) are the shared vocabulary's (token_proxy/vocabulary.py).
It imports no feature: features hook in (MODEL_RESOLVER)."""

from token_proxy.pipeline.job import Job
from token_proxy.pipeline.request_state import RequestStats, stats_of
from token_proxy.pipeline.run import MODEL_RESOLVER, Endpoint, Formatter, prepare, run_pipeline

__all__ = [
    "MODEL_RESOLVER",
    "Endpoint",
    "Formatter",
    "Job",
    "RequestStats",
    "prepare",
    "run_pipeline",
    "stats_of",
]
