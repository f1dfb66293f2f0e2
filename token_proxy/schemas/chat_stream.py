"""SGLang /generate stream events -> vLLM's chat.completion.chunk sequence.

SGLang streams either cumulatively (default: every event repeats all text, ids and
logprobs so far) or incrementally (--incremental-streaming-output). Both become the
same deltas here. Text that could still turn into a stop string, or that ends in an
incomplete UTF-8 character (U+FFFD), is held back; its token ids are sent at once
with an empty delta, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from token_proxy.schemas.chat_request import ChatRequest
from token_proxy.schemas.chat_response import ResponseMeta, usage
from token_proxy.schemas.generation import map_finish
from token_proxy.schemas.logprobs import TokenNamer, chat_logprob_content

REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class _Choice:
    text: str = ""  # all text so far, as SGLang reported it
    sent_chars: int = 0
    ids_seen: int = 0
    logprobs_seen: int = 0
    ids: list = field(default_factory=list)  # kept only while the proxy enforces stop ids
    finished: bool = False


class ChatStreamTranslator:
    def __init__(self, req: ChatRequest, meta: ResponseMeta, namer: TokenNamer, incremental: bool):
        self._req = req
        self._meta = meta
        self._namer = namer
        self._incremental = incremental
        self._choices = [_Choice() for _ in range(req.sampling.n)]
        self._holdback = max((len(s) for s in req.sampling.stop), default=1) - 1
        self._eos = None if req.sampling.ignore_eos else meta.eos_token_id
        self._cached_tokens = 0
        self._stop_ids = req.sampling.proxy_stop_ids
        self.weight_version: str | None = None  # as SGLang reports it in meta_info
        self.cut_short = False  # True once the proxy ended a choice SGLang is still generating
        # vLLM honours continuous_usage_stats only together with include_usage.
        self._continuous_usage = req.output.include_usage and req.output.continuous_usage_stats

    @property
    def completion_tokens(self) -> int:
        return self._total_completion()

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    @property
    def done(self) -> bool:
        return all(c.finished for c in self._choices)

    def start(self) -> list[dict]:
        """One role chunk per choice, each carrying the prompt ids (null unless asked)."""
        chunks = []
        for index in range(len(self._choices)):
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            chunk = self._chunk(choice, completion_tokens=0)
            chunk["prompt_token_ids"] = self._meta.prompt_ids if self._req.output.return_token_ids else None
            chunk["prompt_text"] = None
            chunks.append(chunk)
        return chunks

    def feed(self, event: dict) -> list[dict]:
        index = event.get("index", 0)
        if not 0 <= index < len(self._choices) or self._choices[index].finished:
            return []
        state = self._choices[index]
        meta = event.get("meta_info") or {}
        self._cached_tokens = meta.get("cached_tokens") or self._cached_tokens
        self.weight_version = meta.get("weight_version", self.weight_version)
        new_ids = self._new_items(event.get("output_ids") or [], state.ids_seen)
        new_logprobs = self._new_items(meta.get("output_token_logprobs") or [], state.logprobs_seen)
        new_top = self._new_items(meta.get("output_top_logprobs") or [], state.logprobs_seen)
        state.ids_seen += len(new_ids)
        state.logprobs_seen += len(new_logprobs)
        finish = meta.get("finish_reason")
        self._take_text(state, event.get("text") or "")
        if self._stop_ids:
            new_ids, new_logprobs, new_top, finish = self._cut_at_stop_id(state, new_ids, new_logprobs, new_top,
                                                                          finish)
        delta_text = self._releasable(state, final=finish is not None, finish=finish)
        if not new_ids and not delta_text and finish is None:
            return []
        choice = self._content_choice(index, delta_text, new_ids, new_logprobs, new_top)
        if finish is None:
            return [self._chunk(choice, state.ids_seen, kv_transfer_params=None)]
        state.finished = True
        return [self._finish_chunk(choice, state, finish)]

    def finish(self) -> list[dict]:
        """The usage chunk, when asked for (None fields dropped, as vLLM does); [DONE] is the writer's."""
        if not self._req.output.include_usage:
            return []
        report = usage(len(self._meta.prompt_ids), self._total_completion(), self._cached_tokens)
        report = {k: v for k, v in report.items() if v is not None}
        return [{"id": self._meta.response_id, "object": "chat.completion.chunk", "created": self._meta.created,
                 "model": self._meta.model, "choices": [], "usage": report}]

    def _cut_at_stop_id(self, state: _Choice, ids: list, logprobs: list, top: list, finish):
        """vLLM stops at a stop id even under ignore_eos; SGLang does not, so the proxy does (and
        the caller aborts the SGLang request once `cut_short`)."""
        cut = next((i for i, t in enumerate(ids) if t in self._stop_ids), None)
        if cut is None:
            state.ids.extend(ids)
            return ids, logprobs, top, finish
        state.ids.extend(ids[: cut + 1])
        state.ids_seen = len(state.ids)
        state.text = self._namer.decode(state.ids[:-1], self._req.sampling.skip_special_tokens)
        self.cut_short = True
        return ids[: cut + 1], logprobs[: cut + 1], top[: cut + 1], {"type": "stop", "matched": ids[cut]}

    def _finish_chunk(self, choice: dict, state: _Choice, finish: dict) -> dict:
        if state.ids_seen == 0 and not choice["delta"].get("content"):
            choice["delta"] = {}
        choice["finish_reason"], choice["stop_reason"] = map_finish(finish, self._eos)
        choice["finish_reason"] = choice["finish_reason"] or "stop"
        choice["token_ids"] = choice.pop("token_ids")  # keep vLLM's key order
        choice["weight_versions"] = None
        chunk = self._chunk(choice, state.ids_seen)
        if not self._req.output.include_usage:
            chunk["system_fingerprint"] = None  # vLLM puts it on the last message only
        chunk["kv_transfer_params"] = None
        return chunk

    def _new_items(self, items: list, seen: int) -> list:
        return items if self._incremental else items[seen:]

    def _take_text(self, state: _Choice, text: str) -> None:
        if self._incremental:
            state.text += text
        elif text.startswith(state.text[: state.sent_chars]):
            state.text = text
        # else: SGLang rewrote text already sent (cannot be unsent); keep what we had.

    def _releasable(self, state: _Choice, final: bool, finish: dict | None) -> str:
        if final:
            end = len(self._final_text(state, finish))
        else:
            end = max(state.sent_chars, len(state.text) - self._holdback)
            while end > state.sent_chars and state.text[end - 1] == REPLACEMENT:
                end -= 1
        delta = state.text[state.sent_chars:end]
        state.sent_chars = max(state.sent_chars, end)
        return delta

    def _final_text(self, state: _Choice, finish: dict | None) -> str:
        """Incremental streams may still end in the stop string; vLLM trims it unless asked not to."""
        matched = (finish or {}).get("matched")
        text = state.text
        if (isinstance(matched, str) and not self._req.sampling.include_stop_str_in_output
                and text.endswith(matched)):
            text = text[: len(text) - len(matched)]
        return text

    def _content_choice(self, index: int, text: str, ids: list, logprobs: list, top: list) -> dict:
        choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        if self._req.sampling.logprobs:
            content = chat_logprob_content(logprobs, top, self._req.sampling.top_logprobs, self._namer)
            choice["logprobs"] = {"content": content}
        choice["token_ids"] = ids if self._req.output.return_token_ids else None
        return choice

    def _chunk(self, choice: dict, completion_tokens: int, **extra) -> dict:
        chunk = {"id": self._meta.response_id, "object": "chat.completion.chunk", "created": self._meta.created,
                 "model": self._meta.model, "choices": [choice]}
        if self._continuous_usage:
            prompt = len(self._meta.prompt_ids)
            chunk["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt + completion_tokens,
                              "completion_tokens": completion_tokens, "completion_tokens_details": None}
        chunk.update(extra)
        return chunk

    def _total_completion(self) -> int:
        return sum(c.ids_seen for c in self._choices)
