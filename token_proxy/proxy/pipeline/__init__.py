"""The inference pipeline (see ARCHITECTURE.md): run_pipeline(request, endpoint) and its hooks."""

from token_proxy.proxy.pipeline.run import Endpoint, Formatter, Job, checked_seed, output_rules, run_pipeline
from token_proxy.proxy.pipeline.target import ModelTarget, resolve_model, resolve_target

__all__ = ["Endpoint", "Formatter", "Job", "ModelTarget", "checked_seed", "output_rules", "resolve_model", "resolve_target",
           "run_pipeline"]
