"""POST /v1/completions: the request (request.py), its endpoint adapter of the pipeline
(endpoint.py) and vLLM's body and chunks (format.py)."""

from token_proxy.api.completions.endpoint import completions
from token_proxy.api.completions.request import CompletionRequest, parse_completion_request

__all__ = [
    "CompletionRequest", "completions", "parse_completion_request",
]
