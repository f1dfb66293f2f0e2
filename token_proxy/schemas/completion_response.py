"""vLLM's /v1/completions body and stream chunks, built from SGLang generations.

With `return_token_ids`, `prompt_token_ids` and `token_ids` are per choice (no top-level
prompt ids, unlike chat). Choice i*n + j is sample j of prompt i. `echo` prepends the
prompt text (vLLM leaves it out when token ids are returned) and the prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

from token_proxy.schemas.chat_response import usage
from token_proxy.schemas.completion_request import CompletionRequest
from token_proxy.schemas.generation import Generation, map_finish
from token_proxy.schemas.logprobs import TokenNamer, completion_logprobs, prompt_logprobs
from token_proxy.schemas.stream_deltas import DeltaTracker, StreamTranslator
from token_proxy.schemas.weight_versions import whole_output


@dataclass(frozen=True, slots=True)
class CompletionMeta:
    response_id: str
    created: int
    model: str
    prompt_ids: list[list[int]]  # per prompt
    prompt_texts: list[str]  # per prompt (decoded when the prompt came as ids)
    eos_token_id: int | None


def _echo_text(req: CompletionRequest, meta: CompletionMeta, prompt: int) -> str:
    return "" if req.output.return_token_ids else meta.prompt_texts[prompt]


def _logprobs(req: CompletionRequest, gen_meta: dict, triples: list, rows: list | None, namer: TokenNamer,
              echo: bool, offset: int = 0) -> dict | None:
    if not req.sampling.logprobs:
        return None
    if echo:
        triples = (gen_meta.get("input_token_logprobs") or []) + triples
        rows = (gen_meta.get("input_top_logprobs") or []) + (rows or [])
    return completion_logprobs(triples, rows, req.sampling.top_logprobs, namer, offset)


def completion_choice(req: CompletionRequest, meta: CompletionMeta, gen: Generation, namer: TokenNamer) -> dict:
    prompt = gen.index // req.sampling.n
    finish_reason, stop_reason = map_finish(gen.finish, None if req.sampling.ignore_eos else meta.eos_token_id)
    text = _echo_text(req, meta, prompt) + gen.text if req.echo else gen.text
    lps = _logprobs(req, gen.meta, gen.meta.get("output_token_logprobs") or [],
                    gen.meta.get("output_top_logprobs"), namer, req.echo)
    prompt_lps = None
    if req.sampling.prompt_logprobs is not None:
        prompt_lps = prompt_logprobs(gen.meta.get("input_token_logprobs") or [],
                                     gen.meta.get("input_top_logprobs"), req.sampling.prompt_logprobs, namer)
    rti = req.output.return_token_ids
    return {"index": gen.index, "text": text, "logprobs": lps, "finish_reason": finish_reason or "stop",
            "stop_reason": stop_reason, "token_ids": gen.token_ids if rti else None, "prompt_logprobs": prompt_lps,
            "prompt_token_ids": meta.prompt_ids[prompt] if rti else None, "routed_experts": None,
            "weight_versions": whole_output(gen.weight_version, len(gen.token_ids))}


def completion_response(req: CompletionRequest, meta: CompletionMeta, gens: list[Generation],
                        namer: TokenNamer) -> dict:
    gens = sorted(gens, key=lambda g: g.index)
    prompt_tokens = sum(len(ids) for ids in meta.prompt_ids)
    return {
        "id": meta.response_id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "choices": [completion_choice(req, meta, g, namer) for g in gens],
        "service_tier": None, "system_fingerprint": None,
        "usage": usage(prompt_tokens, sum(len(g.token_ids) for g in gens), gens[0].cached_tokens if gens else 0),
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }


class CompletionStreamTranslator(StreamTranslator):
    """Stream deltas -> vLLM's text_completion chunks (no role chunk; prompt ids on a choice's first)."""

    def __init__(self, req: CompletionRequest, meta: CompletionMeta, namer: TokenNamer, incremental: bool):
        self._req = req
        self._meta = meta
        self._namer = namer
        choices = len(meta.prompt_ids) * req.sampling.n
        skip = req.sampling.skip_special_tokens
        self._deltas = DeltaTracker(req.sampling, choices, incremental, lambda ids: namer.decode(ids, skip))
        self._offsets = [0] * choices  # text offset of each choice's next logprob token

    def feed(self, event: dict) -> list[dict]:
        delta = self._deltas.feed(event)
        if delta is None:
            return []
        prompt = delta.index // self._req.sampling.n
        echo = self._req.echo and delta.first
        text = _echo_text(self._req, self._meta, prompt) + delta.text if echo else delta.text
        lps = _logprobs(self._req, delta.meta, delta.logprobs, delta.top_logprobs, self._namer, echo,
                        self._offsets[delta.index])
        if lps and lps["tokens"]:
            self._offsets[delta.index] = lps["text_offset"][-1] + len(lps["tokens"][-1])
        finish_reason, stop_reason = map_finish(delta.finish, None if self._req.sampling.ignore_eos
                                                else self._meta.eos_token_id)
        rti = self._req.output.return_token_ids
        choice = {"index": delta.index, "text": text, "logprobs": lps, "finish_reason": finish_reason,
                  "stop_reason": stop_reason,
                  "prompt_token_ids": self._meta.prompt_ids[prompt] if rti and delta.first else None,
                  "token_ids": delta.token_ids if rti else None, "weight_versions": delta.weight_versions}
        return [{"id": self._meta.response_id, "object": "text_completion", "created": self._meta.created,
                 "model": self._meta.model, "choices": [choice], "kv_transfer_params": None}]

    def finish(self) -> list[dict]:
        if not self._req.output.include_usage:
            return []
        prompt_tokens = sum(len(ids) for ids in self._meta.prompt_ids)
        report = usage(prompt_tokens, self._deltas.completion_tokens, self._deltas.cached_tokens)
        return [{"id": self._meta.response_id, "object": "text_completion", "created": self._meta.created,
                 "model": self._meta.model, "choices": [],
                 "usage": {k: v for k, v in report.items() if v is not None}}]
