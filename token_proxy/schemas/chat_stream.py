"""Stream deltas -> vLLM's chat.completion.chunk sequence.

Key presence follows vLLM 0.33's `model_dump_json(exclude_unset=True)`: the role chunk
carries `prompt_token_ids` (null unless asked) and `prompt_text`; content chunks carry
`token_ids` and `kv_transfer_params`; the finish chunk adds `stop_reason` and
`weight_versions`; the usage chunk drops every null.
"""

from __future__ import annotations

from token_proxy.schemas.chat_request import ChatRequest
from token_proxy.schemas.chat_response import ResponseMeta, usage
from token_proxy.schemas.generation import map_finish
from token_proxy.schemas.logprobs import TokenNamer, chat_logprob_content
from token_proxy.schemas.stream_deltas import Delta, DeltaTracker, StreamTranslator


class ChatStreamTranslator(StreamTranslator):
    def __init__(self, req: ChatRequest, meta: ResponseMeta, namer: TokenNamer, incremental: bool):
        self._req = req
        self._meta = meta
        self._namer = namer
        skip = req.sampling.skip_special_tokens
        self._deltas = DeltaTracker(req.sampling, req.sampling.n, incremental,
                                    lambda ids: namer.decode(ids, skip))
        self._eos = None if req.sampling.ignore_eos else meta.eos_token_id
        # vLLM honours continuous_usage_stats only together with include_usage.
        self._continuous_usage = req.output.include_usage and req.output.continuous_usage_stats

    def start(self) -> list[dict]:
        """One role chunk per choice, each carrying the prompt ids (null unless asked)."""
        chunks = []
        for index in range(self._req.sampling.n):
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            chunk = self._chunk(choice, completion_tokens=0)
            chunk["prompt_token_ids"] = self._meta.prompt_ids if self._req.output.return_token_ids else None
            chunk["prompt_text"] = None
            chunks.append(chunk)
        return chunks

    def feed(self, event: dict) -> list[dict]:
        delta = self._deltas.feed(event)
        if delta is None:
            return []
        choice = self._content_choice(delta)
        tokens = self._deltas.choice_tokens(delta.index)
        if delta.finish is None:
            return [self._chunk(choice, tokens, kv_transfer_params=None)]
        return [self._finish_chunk(choice, delta, tokens)]

    def finish(self) -> list[dict]:
        """The usage chunk, when asked for (None fields dropped, as vLLM does); [DONE] is the writer's."""
        if not self._req.output.include_usage:
            return []
        report = usage(len(self._meta.prompt_ids), self.completion_tokens, self.cached_tokens)
        report = {k: v for k, v in report.items() if v is not None}
        return [{"id": self._meta.response_id, "object": "chat.completion.chunk", "created": self._meta.created,
                 "model": self._meta.model, "choices": [], "usage": report}]

    def _content_choice(self, delta: Delta) -> dict:
        choice = {"index": delta.index, "delta": {"content": delta.text}, "logprobs": None, "finish_reason": None}
        if self._req.sampling.logprobs:
            content = chat_logprob_content(delta.logprobs, delta.top_logprobs, self._req.sampling.top_logprobs,
                                           self._namer)
            choice["logprobs"] = {"content": content}
        choice["token_ids"] = delta.token_ids if self._req.output.return_token_ids else None
        return choice

    def _finish_chunk(self, choice: dict, delta: Delta, tokens: int) -> dict:
        if tokens == 0 and not delta.text:
            choice["delta"] = {}
        finish_reason, stop_reason = map_finish(delta.finish, self._eos)
        choice["finish_reason"] = finish_reason or "stop"
        choice["stop_reason"] = stop_reason
        choice["token_ids"] = choice.pop("token_ids")  # keep vLLM's key order
        choice["weight_versions"] = delta.weight_versions
        chunk = self._chunk(choice, tokens)
        if not self._req.output.include_usage:
            chunk["system_fingerprint"] = None  # vLLM puts it on the last message only
        chunk["kv_transfer_params"] = None
        return chunk

    def _chunk(self, choice: dict, completion_tokens: int, **extra) -> dict:
        chunk = {"id": self._meta.response_id, "object": "chat.completion.chunk", "created": self._meta.created,
                 "model": self._meta.model, "choices": [choice]}
        if self._continuous_usage:
            prompt = len(self._meta.prompt_ids)
            chunk["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt + completion_tokens,
                              "completion_tokens": completion_tokens, "completion_tokens_details": None}
        chunk.update(extra)
        return chunk
