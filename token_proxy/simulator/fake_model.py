"""A deterministic stand-in for a language model's forward pass.

The "model" is a pure function of the context (prompt + output so far) and the
weight version: a 64-bit rolling hash of the context picks a few candidate
tokens and their logits. Greedy decoding is therefore reproducible, a prompt
that extends an earlier context continues it the same way, and a weight update
changes the outputs — the properties a proxy or an RL loop can observe.
"""

from __future__ import annotations

import hashlib
import struct

from token_proxy.simulator.vocab import Vocab

MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15
NUM_CANDIDATES = 8
LOGIT_SPAN = 6.0  # candidate logits lie in [0, 6): peaked enough that sampling is not uniform
# Every token outside the candidate set is treated as having this logit, so a
# logprob asked for any id (token_ids_logprob, logit_bias targets) stays finite.
BACKGROUND_LOGIT = -14.0
_WORDS = struct.Struct(f"<{NUM_CANDIDATES}I")  # one 32-bit word per candidate: 18 bits id, 14 bits logit
_LOGIT_STEP = LOGIT_SPAN / (1 << 14)
EOS_ONE_IN = 64  # how often EOS is among the candidates (greedy then stops ~1 in 600 steps)
SPLIT_ONE_IN = 8  # how often a character-splitting byte token is among them


def mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def initial_context(weight_version: str) -> int:
    digest = hashlib.blake2b(weight_version.encode(), digest_size=8, person=b"sim-lm").digest()
    return int.from_bytes(digest, "little")


def advance(context: int, token_id: int) -> int:
    return mix64(context ^ ((token_id + 1) * GOLDEN64 & MASK64))


def context_of(token_ids, weight_version: str) -> int:
    context = initial_context(weight_version)
    for token_id in token_ids:
        context = advance(context, token_id)
    return context


def candidate_logits(context: int, pending: int, vocab: Vocab, eos_id: int) -> dict[int, float]:
    """The candidates for the next token and their logits.

    `pending` counts continuation bytes owed to a character split by the last
    tokens; while it is non-zero only continuation bytes are offered, so the
    output stays valid UTF-8 unless a caller forces something else in.
    """
    words = _WORDS.unpack(hashlib.blake2b(context.to_bytes(8, "little"), digest_size=_WORDS.size).digest())
    pool = vocab.continuation_ids if pending else vocab.clean_ids
    size = len(pool)
    logits = {pool[(word & 0x3FFFF) % size]: (word >> 18) * _LOGIT_STEP for word in words}
    if not pending:
        _add_rare_candidates(logits, mix64(context ^ GOLDEN64), vocab, eos_id)
    return logits


def _add_rare_candidates(logits: dict[int, float], dice: int, vocab: Vocab, eos_id: int) -> None:
    # Use a logit drawn from the same range, so a rare candidate wins greedy
    # decoding about one time in NUM_CANDIDATES when it is present.
    logit = (dice >> 40) * (LOGIT_SPAN / (1 << 24))
    if dice % EOS_ONE_IN == 0:
        logits[eos_id] = logit
    elif (dice >> 8) % SPLIT_ONE_IN == 0:
        lead_id, _ = vocab.lead_ids[(dice >> 16) % len(vocab.lead_ids)]
        logits[lead_id] = logit


def pending_after(pending: int, data: bytes) -> int:
    """Continuation bytes still owed after appending `data` (a tiny UTF-8 state machine)."""
    for byte in data:
        if pending and 0x80 <= byte < 0xC0:
            pending -= 1
        elif 0xC0 <= byte < 0xE0:
            pending = 1
        elif 0xE0 <= byte < 0xF0:
            pending = 2
        elif 0xF0 <= byte < 0xF8:
            pending = 3
        else:
            pending = 0
    return pending
