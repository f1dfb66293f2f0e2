"""The one post-processing step every endpoint's output passes through, streaming or not.

SGLang's /generate events (a stream's events, or a non-streaming reply seen as one event per
choice) become per-choice `Output`s in vLLM's terms. Every output rule lives here, so no
endpoint can drift from another:
- stop ids under ignore_eos (SGLang's ignore_eos disables stop_token_ids, vLLM's does not:
  the proxy cuts at the first stop id and the relay aborts the SGLang request);
- stop strings (text that could still become one is held back; a trailing match is trimmed
  unless include_stop_str_in_output);
- finish_reason / stop_reason in vLLM's words; usage counts; weight-version spans;
- SGLang's two stream modes (cumulative or --incremental-streaming-output) give the same outputs.
Text ending in an incomplete UTF-8 character (U+FFFD) is held back; its token ids go out at once.

`feed` runs once per stream event, that is per token: `feed_running` is `feed` for the common event (a
plain stream's started choice going on), for the stream's chunk template (pipeline/stream_frames.py). Both
run one core, `_advance` (every state change an event makes, the text that can go out included);
`feed` adds the choice's start and finish around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from token_proxy.vocabulary import FinishedChoice, Output, SamplingRequest, Usage

REPLACEMENT = "\ufffd"
_NO_FINISH = {"type": "stop", "matched": None}  # a non-streaming reply without finish_reason
_EMPTY: dict = {}
_NO_ITEMS: list = []  # never changed: an event without ids or logprobs
# An incremental choice keeps only text not yet sent plus the longest stop string's length of sent text
# (what a final stop-string trim may look at): past this many sent characters, the rest is dropped, so
# a long output is not copied whole on every event (quadratic: seconds of CPU at 64k tokens).
_COMPACT_AT = 4096
NOT_RUNNING = object()  # feed_running: not a running choice's plain event, use `feed`


def proxy_stop_ids(sampling: SamplingRequest) -> frozenset[int]:
    """Stop ids the proxy must enforce itself: SGLang's ignore_eos also disables stop_token_ids,
    vLLM's does not."""
    return frozenset(sampling.stop_token_ids) if sampling.ignore_eos else frozenset()


def map_finish(finish: dict | None, eos_token_id: int | None) -> tuple[str | None, int | str | None]:
    """SGLang's finish_reason -> vLLM's (finish_reason, stop_reason).

    The tokenizer's EOS -> ("stop", None); any other stop id (a requested one, or an
    extra EOS from generation_config, which vLLM adds to stop_token_ids) -> ("stop", id);
    a stop string -> ("stop", string); max tokens or the context end -> ("length", None).
    Pass eos_token_id=None under ignore_eos: vLLM then reports every stop id.
    """
    if not finish:
        return None, None
    kind = finish.get("type")
    if kind == "stop":
        matched = finish.get("matched")
        if isinstance(matched, bool) or matched is None or matched == eos_token_id:
            return "stop", None
        return "stop", matched
    if kind == "length":
        return "length", None
    if kind == "abort":
        return "abort", None
    return str(kind), None


@dataclass(slots=True)
class _Choice:
    text: str = ""  # all text so far, as SGLang reported it (its sent head dropped, see _COMPACT_AT)
    sent_chars: int = 0  # of `text`
    ids_seen: int = 0
    logprobs_seen: int = 0
    ids: list = field(default_factory=list)  # kept only while the proxy enforces stop ids
    started: bool = False
    finished: bool = False
    version: object = None  # the weight version last tracked (most events repeat it)


# vLLM's `weight_versions` (WeightVersionSpan: output tokens [start, end) were sampled by weights labelled
# `version`) from the weight_version SGLang reports in each reply's meta_info. A stream sees the version of
# every event, so a choice that spans a weight update gets one span per version, split where the version
# changed. A non-streaming reply carries only the version SGLang reported when it finished; its single span
# covers the whole output (the output rules see it as one event).

def span(version: str, start: int, end: int) -> dict:
    return {"version": version, "start": start, "end": end}


class VersionSpans:
    """Per choice: where each version started producing tokens (vLLM's track_weight_version)."""

    def __init__(self) -> None:
        self._starts: dict[int, list[tuple[str, int]]] = {}

    def track(self, index: int, version, tokens_before: int) -> None:
        """Choice `index` produced tokens from `tokens_before` on with weights `version` (called when the
        version differs from the last one tracked)."""
        starts = self._starts.setdefault(index, [])
        if not starts or starts[-1][0] != str(version):
            starts.append((str(version), tokens_before))

    def spans(self, index: int, num_tokens: int, reported=None) -> list[dict] | None:
        """SGLang 0.5.19+ reports exact spans on a finished reply (`reported`): those win, cut to
        `num_tokens` (the proxy may end a choice early at a stop id)."""
        if isinstance(reported, list) and reported and all(isinstance(s, dict) for s in reported):
            return [span(str(s.get("version")), s.get("start", 0), min(s.get("end", num_tokens), num_tokens))
                    for s in reported if s.get("start", 0) < num_tokens or s.get("start", 0) == 0]
        starts = self._starts.get(index)
        if not starts:
            return None
        ends = [start for _, start in starts[1:]] + [num_tokens]
        return [span(version, start, end) for (version, start), end in zip(starts, ends)]


class OutputRules:
    """Per request: SGLang events in, `Output`s out (`feed` per stream event, `whole` for a reply)."""

    def __init__(self, sampling: SamplingRequest, choices: int, prompt_tokens: int, eos_token_id: int | None,
                 decode, incremental: bool = True):
        """`decode(ids)` re-spells a choice cut at a stop id (only used under ignore_eos + stop_token_ids)."""
        self._sampling = sampling
        self._incremental = incremental
        self._decode = decode
        self._choices = [_Choice() for _ in range(choices)]
        self._holdback = max((len(s) for s in sampling.stop), default=1) - 1
        self._stop_ids = proxy_stop_ids(sampling)
        # Under proxy stop ids a cut re-spells the whole choice (_cut_at_stop_id): nothing is dropped.
        self._compact_at = None if self._stop_ids or not incremental else self._holdback + 1 + _COMPACT_AT
        self._eos = None if sampling.ignore_eos else eos_token_id  # under ignore_eos vLLM names every stop id
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.weight_version: str | None = None  # as SGLang reports it in meta_info
        self.cut_short = False  # True once the proxy ended a choice SGLang is still generating
        self._versions = VersionSpans()  # a choice that spans a weight update reports each version
        self.finished: list[FinishedChoice] = []  # one per finished choice (the vllm: request series)

    @property
    def plain(self) -> bool:
        """A stream whose running events are text and ids only: one choice, SGLang's deltas, no stop
        strings, no proxy-enforced stop ids (`feed_running` serves these)."""
        return len(self._choices) == 1 and self._incremental and not self._holdback and not self._stop_ids

    @property
    def done(self) -> bool:
        return all(c.finished for c in self._choices)

    @property
    def started_choices(self) -> int:
        return sum(c.started for c in self._choices)

    @property
    def completion_tokens(self) -> int:
        choices = self._choices  # read per stream event (the metrics' tokens per event): one choice, no generator
        return choices[0].ids_seen if len(choices) == 1 else sum(c.ids_seen for c in choices)

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def whole(self, items: list[dict]) -> list[Output]:
        """A non-streaming reply (one item per choice) -> one finished Output per choice, by index."""
        outputs = []
        for i, item in enumerate(items):
            meta = item.get("meta_info") or {}
            if meta.get("finish_reason") is None:
                item = dict(item, meta_info=dict(meta, finish_reason=_NO_FINISH))
            out = self._feed(item.get("index", i), item)
            if out is not None:
                outputs.append(out)
        if len(outputs) > 1:
            outputs.sort(key=lambda o: o.index)
        return outputs

    def feed(self, event: dict) -> Output | None:
        """One stream event -> the new output of its choice (None when there is nothing to send yet)."""
        return self._feed(event.get("index", 0), event)

    def _feed(self, index: int, event: dict) -> Output | None:
        if not 0 <= index < len(self._choices) or self._choices[index].finished:
            return None
        state = self._choices[index]
        meta = event.get("meta_info") or {}
        new = self._advance(state, index, event, meta, meta.get("finish_reason"))
        if new is None:
            return None
        text, ids, logprobs, top, finish = new
        first, state.started = not state.started, True
        if finish is None:
            return Output(index, text, ids, logprobs, top, None, None, first, meta, state.ids_seen)
        state.finished = True
        finish_reason, stop_reason = map_finish(finish, self._eos)
        prompt = meta.get("prompt_tokens")  # the choice's own prompt (several prompts: each its own)
        self.finished.append(FinishedChoice(finish_reason, prompt if isinstance(prompt, int) else self.prompt_tokens,
                                            state.ids_seen))
        return Output(index, text, ids, logprobs, top, finish_reason, stop_reason, first, meta, state.ids_seen,
                      self._versions.spans(index, state.ids_seen, meta.get("weight_versions")))

    def feed_running(self, event: dict) -> tuple | object | None:
        """`feed` for a `plain` stream's event that continues its started choice -> `_advance`'s tuple (use
        its first two items, the new text and ids) or None; any other event (the first, the last, another
        index) returns NOT_RUNNING untouched: `feed` it."""
        meta = event.get("meta_info") or _EMPTY
        state = self._choices[0]
        if not state.started or state.finished or meta.get("finish_reason") is not None or event.get("index", 0):
            return NOT_RUNNING
        return self._advance(state, 0, event, meta, None)

    def _advance(self, state: _Choice, index: int, event: dict, meta: dict, finish) -> tuple | None:
        """Every state change one event makes to its choice -> (text, ids, logprobs, top, finish) to send, or
        None when there is nothing to send yet: cached tokens and the weight version from meta_info; the new
        ids and logprobs (a cumulative stream's events repeat what was seen) counted; the text taken (an
        incremental one compacted, see _COMPACT_AT); a proxy stop id cut (it sets `finish`); the text that
        can be released; the weight version's span. `_feed` adds the choice's start and finish."""
        cached = meta.get("cached_tokens")
        if cached:
            self.cached_tokens = cached
        version = meta.get("weight_version")
        if "weight_version" in meta:  # even null: SGLang says which weights, or that it does not know
            self.weight_version = version
        ids = event.get("output_ids") or _NO_ITEMS
        logprobs = meta.get("output_token_logprobs")
        if logprobs:  # the top rows come with them (SGLang's top_logprobs_num needs return_logprob)
            top = meta.get("output_top_logprobs") or _NO_ITEMS
        else:
            logprobs = top = _NO_ITEMS
        new_text = event.get("text") or ""
        if self._incremental:
            if self._compact_at is not None and state.sent_chars > self._compact_at:
                drop = state.sent_chars - self._holdback - 1  # keep the longest stop string's length
                state.text, state.sent_chars = state.text[drop:], state.sent_chars - drop
            state.text += new_text
        else:
            ids, logprobs, top = ids[state.ids_seen:], logprobs[state.logprobs_seen:], top[state.logprobs_seen:]
            if new_text.startswith(state.text[: state.sent_chars]):
                state.text = new_text
            # else: SGLang rewrote text already sent (cannot be unsent); keep what we had.
        new_tokens = len(ids)
        state.ids_seen += new_tokens
        if logprobs:
            state.logprobs_seen += len(logprobs)
        if self._stop_ids:
            ids, logprobs, top, finish = self._cut_at_stop_id(state, ids, logprobs, top, finish)
            new_tokens = len(ids)
        # The text that can go out now: at the finish, the final text; before it, what cannot be a stop
        # string's start nor an incomplete character.
        text, sent = state.text, state.sent_chars
        if finish is not None:
            end = len(self._final_text(state, finish))
        else:
            end = max(len(text) - self._holdback, sent) if self._holdback else len(text)
            while end > sent and text[end - 1] == REPLACEMENT:  # an incomplete character waits for its end
                end -= 1
        if end > sent:
            state.sent_chars = end
            text = text[sent:end]
        elif ids or finish is not None:
            text = ""
        else:
            return None
        if version is not None and new_tokens and version != state.version:
            state.version = version
            self._versions.track(index, version, state.ids_seen - new_tokens)
        return text, ids, logprobs, top, finish

    def _final_text(self, state: _Choice, finish: dict) -> str:
        """Incremental streams may still end in the stop string; vLLM trims it unless asked not to."""
        matched = finish.get("matched")
        text = state.text
        if isinstance(matched, str) and not self._sampling.include_stop_str_in_output and text.endswith(matched):
            text = text[: len(text) - len(matched)]
        return text

    def _cut_at_stop_id(self, state: _Choice, ids: list, logprobs: list, top: list, finish):
        """vLLM stops at a stop id even under ignore_eos; SGLang does not, so the proxy does (and
        the relay aborts the SGLang request once `cut_short`). The stop token's text is dropped."""
        cut = next((i for i, t in enumerate(ids) if t in self._stop_ids), None)
        if cut is None:
            state.ids.extend(ids)
            return ids, logprobs, top, finish
        state.ids.extend(ids[: cut + 1])
        state.ids_seen = len(state.ids)
        state.text = self._decode(state.ids[:-1])
        self.cut_short = True
        return ids[: cut + 1], logprobs[: cut + 1], top[: cut + 1], {"type": "stop", "matched": ids[cut]}
