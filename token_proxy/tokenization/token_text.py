"""Per-token strings for logprobs, decoded the way vLLM does and cached by id."""

from __future__ import annotations


class TokenTexts:
    """id -> decoded text of that single token (a partial UTF-8 byte decodes to U+FFFD, as in vLLM).

    The cache is bounded by the vocabulary, so it needs no eviction.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = cached
        return cached

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
