"""Byte-level views of the tokenizer that the fake model and the detokenizer share.

Decoding a byte-level BPE is "concatenate each token's bytes, then UTF-8 decode",
so a table id -> bytes lets the simulator decode incrementally in O(new bytes)
instead of re-decoding the whole output per token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

# Lead bytes of 3-byte UTF-8 characters in the CJK block: any continuation byte
# 0x80..0xBF after them gives a valid character, so the fake model can split
# characters across tokens without ever producing invalid UTF-8.
CJK_LEADS = range(0xE4, 0xEA)
CONTINUATIONS = range(0x80, 0xC0)


@dataclass(frozen=True)
class Vocab:
    token_bytes: tuple[bytes, ...]  # id -> bytes; b"" for ids the tokenizer does not know
    special_ids: frozenset[int]  # dropped by skip_special_tokens
    bpe_size: int  # ids below this are ordinary BPE tokens
    clean_ids: tuple[int, ...]  # BPE tokens that are complete UTF-8 on their own
    clean_set: frozenset[int]
    lead_ids: tuple[tuple[int, int], ...]  # (id, continuation bytes still needed)
    continuation_ids: tuple[int, ...]  # the 64 single-byte continuation tokens

    def text_of(self, token_id: int) -> str:
        """One token's text as a logprob entry shows it (lossy for partial characters)."""
        return self.bytes_of(token_id).decode("utf-8", "replace")

    def bytes_of(self, token_id: int) -> bytes:
        return self.token_bytes[token_id] if 0 <= token_id < len(self.token_bytes) else b""


@functools.lru_cache(maxsize=4)
def load_tokenizer(tokenizer_path: str) -> Tokenizer:
    # Cached per path: every test builds an app, and parsing tokenizer.json takes ~0.5 s.
    return Tokenizer.from_file(str(Path(tokenizer_path) / "tokenizer.json"))


@functools.lru_cache(maxsize=4)
def load_vocab(tokenizer_path: str) -> Vocab:
    tokenizer = load_tokenizer(tokenizer_path)
    added = tokenizer.get_added_tokens_decoder()
    bpe = tokenizer.get_vocab(with_added_tokens=False)
    size = max([*bpe.values(), *added.keys()]) + 1
    table = [b""] * size
    translate = _byte_level_translation()
    for token, token_id in bpe.items():
        table[token_id] = token.translate(translate).encode("latin-1")
    for token_id, token in added.items():
        table[token_id] = token.content.encode("utf-8")
    return _build_vocab(tuple(table), added, bpe_size=min(added) if added else size)


def _build_vocab(table: tuple[bytes, ...], added: dict, bpe_size: int) -> Vocab:
    clean = tuple(i for i in range(bpe_size) if table[i] and _is_complete_utf8(table[i]))
    by_bytes = {table[i]: i for i in range(bpe_size)}
    leads = [(by_bytes[bytes([b])], 2) for b in CJK_LEADS if bytes([b]) in by_bytes]
    leads += [
        (i, 1)
        for i in range(bpe_size)
        if len(table[i]) == 2 and table[i][0] in CJK_LEADS and table[i][1] in CONTINUATIONS
    ]
    return Vocab(
        token_bytes=table,
        special_ids=frozenset(i for i, tok in added.items() if tok.special),
        bpe_size=bpe_size,
        clean_ids=clean,
        clean_set=frozenset(clean),
        lead_ids=tuple(leads),
        continuation_ids=tuple(by_bytes[bytes([b])] for b in CONTINUATIONS),
    )


def _is_complete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _byte_level_translation() -> dict[int, int]:
    """GPT-2's bytes_to_unicode, inverted: printable stand-in char -> byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = 256 + extra
            extra += 1
    return {char: byte for byte, char in mapping.items()}
