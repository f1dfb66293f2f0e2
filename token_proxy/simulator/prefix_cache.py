"""A radix-cache stand-in: how many leading prompt tokens an earlier request already computed.

SGLang keys its radix tree by (extra_key, tokens): requests with different extra keys (cache_salt)
never share cached tokens, so each key has its own tree here."""

from __future__ import annotations

# Beyond this many cached tokens the whole cache is dropped, so a long benchmark
# cannot grow the simulator's memory without bound (a real server evicts too).
MAX_CACHED_TOKENS = 2_000_000


class PrefixCache:
    def __init__(self) -> None:
        self._roots: dict[str | None, dict] = {}
        self._size = 0

    def match(self, token_ids, extra_key: str | None = None) -> int:
        """Cached leading tokens, capped at len - 1 as SGLang always recomputes the last one."""
        node, matched = self._roots.get(extra_key, {}), 0
        for token_id in token_ids:
            node = node.get(token_id)
            if node is None:
                break
            matched += 1
        return max(0, min(matched, len(token_ids) - 1))

    def insert(self, token_ids, extra_key: str | None = None) -> None:
        if self._size > MAX_CACHED_TOKENS:
            self.clear()
        node = self._roots.setdefault(extra_key, {})
        for token_id in token_ids:
            child = node.get(token_id)
            if child is None:
                child = node[token_id] = {}
                self._size += 1
            node = child

    def clear(self) -> None:
        self._roots, self._size = {}, 0
