"""POST /tokenize and /detokenize (endpoint.py): the served tokenizer and chat template, no SGLang call."""

from token_proxy.api.tokenize.endpoint import detokenize, tokenize

__all__ = [
    "detokenize", "tokenize",
]
