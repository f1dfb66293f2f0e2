"""SGLang /generate stream events -> per-choice deltas, whatever SGLang's stream mode.

SGLang streams either cumulatively (default: every event repeats all text, ids and
logprobs so far) or incrementally (--incremental-streaming-output). Both become the
same deltas here. Text that could still turn into a stop string, or that ends in an
incomplete UTF-8 character (U+FFFD), is held back; its token ids go out at once, as
vLLM does. Every endpoint's stream builder (chat, completions) formats these deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from token_proxy.schemas.sampling import SamplingRequest
from token_proxy.schemas.weight_versions import VersionSpans

REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class Delta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list  # SGLang triples for token_ids
    top_logprobs: list  # SGLang top rows for token_ids
    finish: dict | None  # SGLang's finish_reason, on a choice's last delta
    first: bool  # the choice's first delta
    meta: dict  # the event's meta_info (e.g. prompt logprobs)
    weight_versions: list[dict] | None = None  # on a choice's last delta: vLLM's spans


@dataclass(slots=True)
class _Choice:
    text: str = ""  # all text so far, as SGLang reported it
    sent_chars: int = 0
    ids_seen: int = 0
    logprobs_seen: int = 0
    ids: list = field(default_factory=list)  # kept only while the proxy enforces stop ids
    started: bool = False
    finished: bool = False


class DeltaTracker:
    def __init__(self, sampling: SamplingRequest, choices: int, incremental: bool, decode):
        """`decode(ids)` is only needed when the proxy enforces stop ids (ignore_eos + stop_token_ids)."""
        self._sampling = sampling
        self._incremental = incremental
        self._decode = decode
        self._choices = [_Choice() for _ in range(choices)]
        self._holdback = max((len(s) for s in sampling.stop), default=1) - 1
        self._stop_ids = sampling.proxy_stop_ids
        self.cached_tokens = 0
        self.weight_version: str | None = None  # as SGLang reports it in meta_info
        self.cut_short = False  # True once the proxy ended a choice SGLang is still generating
        self._versions = VersionSpans()  # a choice that spans a weight update reports each version

    @property
    def done(self) -> bool:
        return all(c.finished for c in self._choices)

    @property
    def completion_tokens(self) -> int:
        return sum(c.ids_seen for c in self._choices)

    def choice_tokens(self, index: int) -> int:
        return self._choices[index].ids_seen

    def feed(self, event: dict) -> Delta | None:
        index = event.get("index", 0)
        if not 0 <= index < len(self._choices) or self._choices[index].finished:
            return None
        state = self._choices[index]
        meta = event.get("meta_info") or {}
        self.cached_tokens = meta.get("cached_tokens") or self.cached_tokens
        self.weight_version = meta.get("weight_version", self.weight_version)
        ids = self._new_items(event.get("output_ids") or [], state.ids_seen)
        logprobs = self._new_items(meta.get("output_token_logprobs") or [], state.logprobs_seen)
        top = self._new_items(meta.get("output_top_logprobs") or [], state.logprobs_seen)
        state.ids_seen += len(ids)
        state.logprobs_seen += len(logprobs)
        finish = meta.get("finish_reason")
        self._take_text(state, event.get("text") or "")
        if self._stop_ids:
            ids, logprobs, top, finish = self._cut_at_stop_id(state, ids, logprobs, top, finish)
        text = self._releasable(state, finish)
        if not ids and not text and finish is None:
            return None
        self._versions.track(index, meta.get("weight_version"), state.ids_seen - len(ids), len(ids))
        first, state.started = not state.started, True
        state.finished = finish is not None
        versions = self._versions.spans(index, state.ids_seen) if state.finished else None
        return Delta(index, text, ids, logprobs, top, finish, first, meta, versions)

    def _new_items(self, items: list, seen: int) -> list:
        return items if self._incremental else items[seen:]

    def _take_text(self, state: _Choice, text: str) -> None:
        if self._incremental:
            state.text += text
        elif text.startswith(state.text[: state.sent_chars]):
            state.text = text
        # else: SGLang rewrote text already sent (cannot be unsent); keep what we had.

    def _releasable(self, state: _Choice, finish: dict | None) -> str:
        if finish is not None:
            end = len(self._final_text(state, finish))
        else:
            end = max(state.sent_chars, len(state.text) - self._holdback)
            while end > state.sent_chars and state.text[end - 1] == REPLACEMENT:
                end -= 1
        delta = state.text[state.sent_chars:end]
        state.sent_chars = max(state.sent_chars, end)
        return delta

    def _final_text(self, state: _Choice, finish: dict) -> str:
        """Incremental streams may still end in the stop string; vLLM trims it unless asked not to."""
        matched = finish.get("matched")
        text = state.text
        if isinstance(matched, str) and not self._sampling.include_stop_str_in_output and text.endswith(matched):
            text = text[: len(text) - len(matched)]
        return text

    def _cut_at_stop_id(self, state: _Choice, ids: list, logprobs: list, top: list, finish):
        """vLLM stops at a stop id even under ignore_eos; SGLang does not, so the proxy does (and
        the caller aborts the SGLang request once `cut_short`)."""
        cut = next((i for i, t in enumerate(ids) if t in self._stop_ids), None)
        if cut is None:
            state.ids.extend(ids)
            return ids, logprobs, top, finish
        state.ids.extend(ids[: cut + 1])
        state.ids_seen = len(state.ids)
        state.text = self._decode(state.ids[:-1])
        self.cut_short = True
        return ids[: cut + 1], logprobs[: cut + 1], top[: cut + 1], {"type": "stop", "matched": ids[cut]}


class StreamTranslator:
    """What the stream relay reads of every endpoint's translator; subclasses format the deltas."""

    _deltas: DeltaTracker

    @property
    def done(self) -> bool:
        return self._deltas.done

    @property
    def cut_short(self) -> bool:
        return self._deltas.cut_short

    @property
    def completion_tokens(self) -> int:
        return self._deltas.completion_tokens

    @property
    def cached_tokens(self) -> int:
        return self._deltas.cached_tokens

    @property
    def weight_version(self) -> str | None:
        return self._deltas.weight_version

    def start(self) -> list[dict]:
        """Chunks before any output (chat's role chunks); none by default."""
        return []
