"""Outputs -> vLLM's /inference/v1/generate reply and stream chunks (token ids out; pure).

The reply follows vLLM 0.33's GenerateTokensResponse, and each logprob entry carries
both 0.33's `token_id` and the `"token": "token_id:<id>"` spelling of vLLM <= 0.31,
which the `renderers` client (0.1.12) checks for: both kinds of client accept it.
"""

from __future__ import annotations

from token_proxy.api.generate.request import GenerateTokensRequest
from token_proxy.api.logprobs import TokenNamer, clamp, prompt_logprobs
from token_proxy.vocabulary import Output, ResponseMeta, Usage


def token_logprobs(triples: list, rows: list | None, top_n: int) -> list[dict]:
    """vLLM's entries: the sampled token with its rank, then the engine's candidates (sampled first)."""
    rows = rows or []
    content = []
    for i, (lp, token_id, *_) in enumerate(triples):
        row = rows[i] if i < len(rows) and rows[i] else []
        ranks = {t: r for r, (_, t, *_) in enumerate(row, start=1)}
        sampled = _entry(token_id, lp, ranks.get(token_id))
        others = [_entry(t, l, ranks[t]) for l, t, *_ in row[:top_n] if t != token_id]
        content.append({**sampled, "top_logprobs": [dict(sampled), *others]})
    return content


def _entry(token_id: int, logprob, rank: int | None) -> dict:
    return {"token_id": token_id, "token": f"token_id:{token_id}", "logprob": clamp(logprob), "rank": rank}


class GenerateFormatter:
    def __init__(self, req: GenerateTokensRequest, meta: ResponseMeta, namer: TokenNamer):
        self._req = req
        self._meta = meta
        self._namer = namer
        self._sent_first = False
        # The prompt ids ride on the stream's first chunk only (see Formatter.plain_chunks).
        self.plain_chunks = not req.sampling.logprobs

    def _choice(self, out: Output) -> dict:
        logprobs = None
        if self._req.sampling.logprobs:
            logprobs = {"content": token_logprobs(out.logprobs, out.top_logprobs, self._req.sampling.top_logprobs)}
        return {"index": out.index, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                "token_ids": out.token_ids, "routed_experts": None, "sampling_mask": None,
                "weight_versions": out.weight_versions, "logprobs": logprobs}

    def response(self, outputs: list[Output], usage: Usage) -> dict:
        prompt_lps = None
        if self._req.sampling.prompt_logprobs is not None and outputs:
            meta = outputs[0].meta
            prompt_lps = prompt_logprobs(meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs"),
                                         self._req.sampling.prompt_logprobs, self._namer)
        return {
            "request_id": self._meta.response_id,
            "model": self._meta.model,
            "created": self._meta.created,
            "usage": usage.body(),
            "prompt_logprobs": prompt_lps,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": self._req.token_ids,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": [self._choice(out) for out in outputs],
        }

    def start(self) -> list[dict]:
        return []

    def chunk(self, out: Output) -> dict:
        """Prompt ids ride on the first chunk only."""
        chunk = {"request_id": self._meta.response_id, "usage": None}
        if not self._sent_first:
            chunk.update(prompt_token_ids=self._req.token_ids, mm_placeholders=None)
            self._sent_first = True
        chunk.update(output_mode="tokens", choices=[self._choice(out)])
        return chunk

    def finish(self, usage: Usage) -> list[dict]:
        if not self._req.include_usage:
            return []
        return [{"request_id": self._meta.response_id, "usage": usage.body(drop_nulls=True),
                 "output_mode": "tokens", "choices": []}]
