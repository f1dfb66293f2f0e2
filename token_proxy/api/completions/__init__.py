"""POST /v1/completions: the request (request.py), its endpoint adapter of the pipeline
(endpoint.py) and vLLM's body and chunks (format.py)."""

from token_proxy.faces import door

__all__ = [
    "CompletionRequest", "completions", "parse_completion_request",
]

__getattr__ = door(__name__, {
    "CompletionRequest": "request",
    "completions": "endpoint",
    "parse_completion_request": "request",
})
