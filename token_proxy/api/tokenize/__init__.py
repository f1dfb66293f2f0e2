"""POST /tokenize and /detokenize (endpoint.py): the served tokenizer and chat template, no SGLang call."""

from token_proxy.faces import door

__all__ = [
    "detokenize", "tokenize",
]

__getattr__ = door(__name__, {
    "detokenize": "endpoint",
    "tokenize": "endpoint",
})
