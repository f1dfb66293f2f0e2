"""POST /inference/v1/generate (token ids in, token ids out): the request (request.py), its
endpoint adapter of the pipeline (endpoint.py) and its reply (format.py)."""

from token_proxy.api.generate.endpoint import generate_tokens
from token_proxy.api.generate.request import GenerateTokensRequest, parse_generate_tokens

__all__ = [
    "GenerateTokensRequest", "generate_tokens", "parse_generate_tokens",
]
