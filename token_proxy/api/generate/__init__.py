"""POST /inference/v1/generate (token ids in, token ids out): the request (request.py), its
endpoint adapter of the pipeline (endpoint.py) and its reply (format.py)."""

from token_proxy.faces import door

__all__ = [
    "GenerateTokensRequest", "generate_tokens", "parse_generate_tokens",
]

__getattr__ = door(__name__, {
    "GenerateTokensRequest": "request",
    "generate_tokens": "endpoint",
    "parse_generate_tokens": "request",
})
