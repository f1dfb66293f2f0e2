"""SGLang logprob triples -> vLLM's chat and completions logprob shapes.

SGLang gives `[logprob, token_id, text_or_null]` per output token and, per position,
a row of such triples for the top-k. vLLM lists, per position, the sampled token
first and then the top-k (without repeating the sampled one), cut to top_logprobs.
"""

from __future__ import annotations

import math

from token_proxy.tokenization.token_text import TokenTexts

CLAMP = -9999.0  # vLLM replaces -inf (and anything below) by this


def clamp(logprob) -> float:
    if logprob is None or math.isnan(logprob):
        return CLAMP
    return max(float(logprob), CLAMP)


class TokenNamer:
    """How a token is spelled in logprobs: its text, or "token_id:<id>"."""

    def __init__(self, texts: TokenTexts, as_ids: bool):
        self._texts = texts
        self._as_ids = as_ids

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_ids else self._texts.text(token_id)

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self._texts.decode(token_ids, skip_special_tokens)

    def text_bytes(self, token_id: int) -> list[int]:
        """vLLM fills the sampled entry's `bytes` from the decoded text even in token-id mode."""
        return list(self._texts.text(token_id).encode("utf-8", "replace"))


def _top_entry(namer: TokenNamer, token_id: int, logprob) -> dict:
    token = namer.name(token_id)
    return {"token": token, "logprob": clamp(logprob), "bytes": list(token.encode("utf-8", "replace"))}


def top_row(sampled_id: int, sampled_lp, row, top_n: int) -> list[tuple[int, float]]:
    """(id, logprob) pairs: the sampled token first, then the top-k without it, cut to top_n."""
    if top_n <= 0:
        return []
    pairs = [(sampled_id, sampled_lp)]
    for lp, token_id, *_ in row or ():
        if token_id != sampled_id:
            pairs.append((token_id, lp))
    return pairs[:top_n]


def chat_logprob_content(token_logprobs: list, top_logprobs: list | None, top_n: int,
                         namer: TokenNamer) -> list[dict]:
    rows = top_logprobs or []
    content = []
    for i, (lp, token_id, *_) in enumerate(token_logprobs):
        row = rows[i] if i < len(rows) else None
        content.append({
            "token": namer.name(token_id),
            "logprob": clamp(lp),
            "bytes": namer.text_bytes(token_id),
            "top_logprobs": [_top_entry(namer, t, l) for t, l in top_row(token_id, lp, row, top_n)],
        })
    return content


def prompt_logprobs(input_logprobs: list, input_top: list | None, top_n: int, namer: TokenNamer) -> list:
    """vLLM's prompt_logprobs: None for the first position, then {id: {logprob, rank, decoded_token}}.

    SGLang reports no rank for a token outside the top-k; it is null there.
    """
    rows = input_top or []
    out: list = []
    for i, (lp, token_id, *_) in enumerate(input_logprobs):
        if i == 0 or lp is None:
            out.append(None)
            continue
        row = [(t, l) for l, t, *_ in (rows[i] if i < len(rows) and rows[i] else [])][:top_n]
        ranks = {t: r for r, (t, _) in enumerate(row, start=1)}
        entry = {str(token_id): {"logprob": clamp(lp), "rank": ranks.get(token_id),
                                 "decoded_token": namer.name(token_id)}}
        for t, l in row:
            entry.setdefault(str(t), {"logprob": clamp(l), "rank": ranks[t], "decoded_token": namer.name(t)})
        out.append(entry)
    return out


def completion_logprobs(token_logprobs: list, top_logprobs: list | None, top_n: int, namer: TokenNamer,
                        text_offset_start: int = 0) -> dict:
    """The completions shape: parallel lists, and per token a {token: logprob} map of the sampled
    token first and the top-k after it (k + 1 entries, as OpenAI defines it). A position with no
    logprob (the first prompt token, when echoed) has null in both."""
    rows = top_logprobs or []
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset_start
    for i, (lp, token_id, *_) in enumerate(token_logprobs):
        token = namer.name(token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(clamp(lp))
        row = rows[i] if i < len(rows) else None
        tops.append({namer.name(t): clamp(l) for t, l in top_row(token_id, lp, row, top_n + 1)})
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}
