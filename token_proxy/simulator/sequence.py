"""One output sequence being generated: the fake model, sampling, stopping and text, token by token."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from token_proxy.simulator.detokenizer import TextTracker, trim_at_stop
from token_proxy.simulator.fake_model import advance, candidate_logits, context_of, pending_after
from token_proxy.simulator.generate_request import SequenceSpec
from token_proxy.simulator.logprobs import LogprobRecord
from token_proxy.simulator.sampler import adjust_logits, choose
from token_proxy.simulator.vocab import Vocab

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@dataclass
class Timing:
    """Wall-clock stamps behind meta_info's *_ts / *_time / latency keys."""

    received: float
    dispatched: float
    forward_entry: float = 0.0
    prefill_finished: float = 0.0
    first_sent: float = 0.0
    finished: float = 0.0


class Sequence:
    def __init__(
        self, spec: SequenceSpec, vocab: Vocab, eos_ids: tuple[int, ...], rng: random.Random, received: float
    ):
        self.spec = spec
        self.rid = spec.rid
        self.output_ids: list[int] = []
        self.finish_reason: dict | None = None
        self.abort_requested = False
        self.started = False
        self.num_retractions = 0
        self.cached_tokens = 0
        self.timing = Timing(received=received, dispatched=time.time())
        self.logprobs = LogprobRecord(spec.logprobs, vocab) if spec.logprobs else None
        self.sent_ids = self.sent_text = 0  # what stream events already carried
        self.version_starts: list[tuple[str, int]] = []  # 0.5.19+: (weight version, first output token)
        self._vocab, self._rng, self._eos_id = vocab, rng, eos_ids[0]
        params = spec.params
        self._stop_ids = frozenset() if params.ignore_eos else params.stop_token_ids | frozenset(eos_ids)
        self._min_ban = params.stop_token_ids | frozenset(eos_ids)
        self._counts = {} if _has_penalties(params) else None
        self._skip = vocab.special_ids if params.skip_special_tokens else frozenset()
        self._text = TextTracker(params)
        self._context = self._pending = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def start(self, weight_key: str, cached_tokens: int) -> None:
        """Prefill: the context hash, prompt logprobs, and the requests that end right here."""
        self.started = True
        self.cached_tokens = cached_tokens
        self.timing.forward_entry = time.time()
        self._context = context_of(self.spec.prompt, weight_key)
        if self.logprobs and self.spec.logprobs.start_len >= 0:
            self.logprobs.record_prompt(self.spec.prompt, weight_key, self._eos_id)
        if self.spec.input_error:
            self.finish_reason = {
                "type": "abort",
                "message": self.spec.input_error,
                "status_code": 400,
                "err_type": "BadRequestError",
            }
        elif self.spec.max_new_tokens == 0:
            self.finish_reason = {"type": "length", "length": 0}
        if self.finish_reason:
            self.timing.finished = time.time()

    def step(self) -> None:
        """Generate one token."""
        params = self.spec.params
        logits = candidate_logits(self._context, self._pending, self._vocab, self._eos_id)
        banned = self._min_ban if len(self.output_ids) < params.min_new_tokens else ()
        logits = adjust_logits(logits, params, self._counts, banned) or {self._vocab.clean_ids[0]: 0.0}
        token_id = self._forced_token(logits)
        if token_id is None:
            token_id = choose(logits, params, self._rng, len(self.spec.prompt) + len(self.output_ids))
        if self.logprobs:
            self.logprobs.record_output(token_id, logits)
        if not self.output_ids:
            self.timing.prefill_finished = time.time()
        self._accept(token_id)

    def _forced_token(self, logits: dict[int, float]) -> int | None:
        """Under a json_schema constraint: the document's next token, then EOS (made the top logit)."""
        forced = self.spec.forced_ids
        if not forced:
            return None
        done = len(self.output_ids)
        token_id = forced[done] if done < len(forced) else self._eos_id
        logits[token_id] = max(logits.values()) + 1.0
        return token_id

    def _accept(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self._context = advance(self._context, token_id)
        if self._counts is not None:
            self._counts[token_id] = self._counts.get(token_id, 0) + 1
        if self._pending or token_id not in self._vocab.clean_set:
            self._pending = pending_after(self._pending, self._vocab.bytes_of(token_id))
        self.finish_reason = self._finish_after(token_id)
        if self.finish_reason:
            self.timing.finished = time.time()

    def _finish_after(self, token_id: int) -> dict | None:
        """Req.update_finish_state's order: length first, then stop strings, then stop tokens."""
        length_hit = len(self.output_ids) >= self.spec.max_new_tokens
        stop_token = token_id in self._stop_ids
        trims_token = stop_token and not length_hit and not self.spec.params.no_stop_trim
        stop_text = None if trims_token else self._text.feed(self._visible_bytes(token_id))
        if length_hit:
            return {"type": "length", "length": self.spec.max_new_tokens}
        if stop_text is not None:
            return {"type": "stop", "matched": stop_text}
        return {"type": "stop", "matched": token_id} if stop_token else None

    def _visible_bytes(self, token_id: int) -> bytes:
        return b"" if token_id in self._skip else self._vocab.bytes_of(token_id)

    def abort(self) -> None:
        self.finish_reason = dict(ABORTED)
        self.timing.finished = time.time()

    def should_emit(self) -> bool:
        """The scheduler's stream_interval rule, and the stop-string hold-back."""
        if self.finished:
            return True
        interval = self.spec.params.stream_interval
        count = len(self.output_ids)
        due = count % interval == 1 if interval > 1 else True
        return due and not self._text.ends_in_stop_prefix()

    @property
    def committed_text(self) -> str:
        return self._text.text

    def final_text(self) -> str:
        matched = self.finish_reason.get("matched") if self.finish_reason else None
        return trim_at_stop(self._text.flush(), matched, self.spec.params.no_stop_trim)


def _has_penalties(params) -> bool:
    return (
        params.frequency_penalty != 0.0 or params.presence_penalty != 0.0 or params.repetition_penalty != 1.0
    )
