"""Outputs -> vLLM's /v1/completions body and stream chunks (pure).

With `return_token_ids`, `prompt_token_ids` and `token_ids` are per choice (no top-level
prompt ids, unlike chat). Choice i*n + j is sample j of prompt i. `echo` prepends the
prompt text (vLLM leaves it out when token ids are returned) and the prompt logprobs.
"""

from __future__ import annotations

from token_proxy.api.completions.request import CompletionRequest
from token_proxy.api.logprobs import TokenNamer, completion_logprobs, prompt_logprobs
from token_proxy.vocabulary import Output, ResponseMeta, Usage


class CompletionFormatter:
    def __init__(self, req: CompletionRequest, meta: ResponseMeta, namer: TokenNamer, prompt_texts: list[str]):
        """`prompt_texts`: per prompt, for echo (decoded when the prompt came as ids)."""
        self._req = req
        self._meta = meta
        self._namer = namer
        self._prompt_texts = prompt_texts
        self._offsets = [0] * (len(meta.prompt_ids) * req.sampling.n)  # text offset of each choice's next token
        # Echo and the prompt ids ride on a choice's first chunk only (see Formatter.plain_chunks).
        self.plain_chunks = not req.sampling.logprobs

    def response(self, outputs: list[Output], usage: Usage) -> dict:
        meta = self._meta
        return {
            "id": meta.response_id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [self._choice(out) for out in outputs],
            "service_tier": None, "system_fingerprint": None, "usage": usage.body(),
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }

    def _choice(self, out: Output) -> dict:
        req = self._req
        prompt = out.index // req.sampling.n
        prompt_lps = None
        if req.sampling.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs(out.meta.get("input_token_logprobs") or [],
                                         out.meta.get("input_top_logprobs"), req.sampling.prompt_logprobs,
                                         self._namer)
        rti = req.output.return_token_ids
        return {"index": out.index, "text": self._text(out, prompt, req.echo), "logprobs": self._logprobs(out, req.echo),
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                "token_ids": out.token_ids if rti else None, "prompt_logprobs": prompt_lps,
                "prompt_token_ids": self._meta.prompt_ids[prompt] if rti else None, "routed_experts": None,
                "weight_versions": out.weight_versions}

    def _text(self, out: Output, prompt: int, echo: bool) -> str:
        if not echo or self._req.output.return_token_ids:
            return out.text
        return self._prompt_texts[prompt] + out.text

    def _logprobs(self, out: Output, echo: bool) -> dict | None:
        if not self._req.sampling.logprobs:
            return None
        triples, rows = out.logprobs, out.top_logprobs
        if echo:
            triples = (out.meta.get("input_token_logprobs") or []) + triples
            rows = (out.meta.get("input_top_logprobs") or []) + (rows or [])
        lps = completion_logprobs(triples, rows, self._req.sampling.top_logprobs, self._namer,
                                  self._offsets[out.index])
        if lps["tokens"]:
            self._offsets[out.index] = lps["text_offset"][-1] + len(lps["tokens"][-1])
        return lps

    def start(self) -> list[dict]:
        return []

    def chunk(self, out: Output) -> dict:
        """No role chunk; the prompt (ids, echo) rides on each choice's first chunk."""
        prompt = out.index // self._req.sampling.n
        echo = self._req.echo and out.first
        rti = self._req.output.return_token_ids
        choice = {"index": out.index, "text": self._text(out, prompt, echo), "logprobs": self._logprobs(out, echo),
                  "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                  "prompt_token_ids": self._meta.prompt_ids[prompt] if rti and out.first else None,
                  "token_ids": out.token_ids if rti else None, "weight_versions": out.weight_versions}
        meta = self._meta
        return {"id": meta.response_id, "object": "text_completion", "created": meta.created, "model": meta.model,
                "choices": [choice], "kv_transfer_params": None}

    def finish(self, usage: Usage) -> list[dict]:
        if not self._req.output.include_usage:
            return []
        meta = self._meta
        return [{"id": meta.response_id, "object": "text_completion", "created": meta.created, "model": meta.model,
                 "choices": [], "usage": usage.body(drop_nulls=True)}]
