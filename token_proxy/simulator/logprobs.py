"""Logprob bookkeeping in SGLang's output shape: [logprob, token_id, text_or_null] triples."""

from __future__ import annotations

from token_proxy.simulator.fake_model import (
    BACKGROUND_LOGIT,
    advance,
    candidate_logits,
    initial_context,
    pending_after,
)
from token_proxy.simulator.generate_request import LogprobOptions
from token_proxy.simulator.sampler import log_softmax
from token_proxy.simulator.vocab import Vocab


class LogprobRecord:
    """Entries are formatted once when recorded, so cumulative stream events just reuse the lists."""

    def __init__(self, options: LogprobOptions, vocab: Vocab):
        self.options = options
        self._vocab = vocab
        self.input_tokens: list = []
        self.input_top: list = []
        self.input_ids_rows: list = []
        self.output_tokens: list = []
        self.output_top: list = []
        self.output_ids_rows: list = []

    def record_output(self, token_id: int, logits: dict[int, float]) -> None:
        logprobs, log_total = log_softmax(logits)
        self.output_tokens.append(self._entry(logprobs[token_id], token_id))
        if self.options.top_n:
            self.output_top.append(self._top_row(logprobs, log_total))
        if self.options.token_ids:
            self.output_ids_rows.append(self._ids_row(logprobs, log_total))

    def record_prompt(self, prompt: list[int], weight_key: str, eos_id: int) -> None:
        """Prompt logprobs from logprob_start_len on; position 0 has no logprob (null)."""
        context, pending = initial_context(weight_key), 0
        for position, token_id in enumerate(prompt):
            if position >= self.options.start_len:
                self._record_prompt_position(position, token_id, context, pending, eos_id)
            context = advance(context, token_id)
            pending = pending_after(pending, self._vocab.bytes_of(token_id))

    def _record_prompt_position(
        self, position: int, token_id: int, context: int, pending: int, eos_id: int
    ) -> None:
        if position == 0:
            self.input_tokens.append(self._entry(None, token_id))
            self.input_top.append(None)
            self.input_ids_rows.append(None)
            return
        logprobs, log_total = log_softmax(candidate_logits(context, pending, self._vocab, eos_id))
        self.input_tokens.append(self._entry(logprobs.get(token_id, BACKGROUND_LOGIT - log_total), token_id))
        if self.options.top_n:
            self.input_top.append(self._top_row(logprobs, log_total))
        if self.options.token_ids:
            self.input_ids_rows.append(self._ids_row(logprobs, log_total))

    def fields(self, output_from: int = 0) -> dict:
        """meta_info's logprob keys in SGLang's order; output lists sliced for incremental streams."""
        fields = {
            "input_token_logprobs": self.input_tokens,
            "output_token_logprobs": self.output_tokens[output_from:],
            "output_token_logprobs_length": len(self.output_tokens),
        }
        if self.options.top_n:
            fields["input_top_logprobs"] = self.input_top
            fields["output_top_logprobs"] = self.output_top[output_from:]
        if self.options.token_ids:
            fields["input_token_ids_logprobs"] = self.input_ids_rows
            fields["output_token_ids_logprobs"] = self.output_ids_rows[output_from:]
        return fields

    def _entry(self, logprob: float | None, token_id: int) -> list:
        return [logprob, token_id, self._vocab.text_of(token_id) if self.options.with_text else None]

    def _top_row(self, logprobs: dict[int, float], log_total: float) -> list:
        ranked = sorted(logprobs.items(), key=lambda item: -item[1])[: self.options.top_n]
        filler = BACKGROUND_LOGIT - log_total
        candidate = 0
        while len(ranked) < self.options.top_n:  # SGLang always returns top_n rows; pad from the flat tail
            if candidate not in logprobs:
                ranked.append((candidate, filler))
            candidate += 1
        return [self._entry(logprob, token_id) for token_id, logprob in ranked]

    def _ids_row(self, logprobs: dict[int, float], log_total: float) -> list:
        filler = BACKGROUND_LOGIT - log_total
        return [self._entry(logprobs.get(token_id, filler), token_id) for token_id in self.options.token_ids]
