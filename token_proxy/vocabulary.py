"""The shared request vocabulary: the values a request's layers hand each other, defined once at the
bottom of the house (it imports nothing of the project), so no reader has to live where a type sits.

- `SamplingRequest`: what a request asks SGLang's sampler for (api/ parses it; the pipeline and
  sglang/payload.py read it);
- `ModelTarget` (with `Hold` and `Reloads`, what it holds): the model a request runs on (pipeline/run.py's
  step 7a resolves it; lora/ makes adapter targets);
- `Output`, `Usage`, `ResponseMeta`: what the output rules (pipeline/output_rules.py) give the endpoints'
  formatters; `FinishedChoice`: what they note of each finished choice for the vllm: request series.

A value's own acts live on it (a target's `release`, vLLM's body of a `Usage`); rules that read the values
live with their readers (the proxy's own stop ids in the output rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

__all__ = ["Hold", "ModelTarget", "Output", "Reloads", "ResponseMeta", "SamplingRequest", "Usage"]

# ---- the request: what is asked for, and on which model

@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """What a request asks SGLang's sampler for, as the endpoints parse it (api/sampling.py): the
    contract between api/, the pipeline and the SGLang payload (sglang/payload.py)."""

    n: int = 1
    max_tokens: int | None = None  # None: the rest of the context, as in vLLM
    max_tokens_param: str = "max_tokens"  # the name the client used, for error messages
    min_tokens: int = 0
    temperature: float | None = None  # None: leave SGLang's (model) default
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logit_bias: dict | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # SGLang's constraint key (json_schema / regex / ebnf / structural_tag) and its value.
    constraint: tuple[str, str] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    # vLLM's per-request "tokens to batch into each streamed chunk"; SGLang 0.5.17 honours the same
    # sampling_params.stream_interval (first token at once, then every N, and the last).
    stream_interval: int | None = None


class Reloads(Protocol):
    """What re-loads lost adapters: LoraAdmin, or a worker process's RemoteLora."""

    async def resync(self) -> None: ...


class Hold(Protocol):
    """A request's hold on what its model needs (a LoRA adapter's version), released when it ends."""

    def release(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ModelTarget:
    """The model a request runs on: `name` is what responses report; `lora_path` (when set) goes to
    SGLang as /generate's `lora_path`, selecting a loaded adapter. An adapter request holds a `lease`
    on the adapter version it resolved, so an in-place reload never unloads it under the request, and
    `reloads` loads it again on a worker that lost it (the call's lost-adapter retry)."""

    name: str
    lora_path: str | None = None
    lease: Hold | None = None  # let go when the request ends (`release`)
    reloads: Reloads | None = None

    def release(self) -> None:
        """The request ended: let go of what its model needed (an adapter's lease), if anything."""
        if self.lease is not None:
            self.lease.release()


# ---- the response: what the output rules give the formatters

@dataclass(slots=True)
class Output:
    """New output of one choice: a stream's delta, or (not streaming) the whole choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list  # SGLang triples [logprob, id, text] for token_ids
    top_logprobs: list  # SGLang top rows for token_ids
    finish_reason: str | None  # vLLM's, on a choice's last output
    stop_reason: int | str | None
    first: bool  # the choice's first output
    meta: dict  # the event's meta_info (e.g. prompt logprobs)
    completion_tokens: int  # the choice's output tokens so far
    weight_versions: list[dict] | None = None  # on a choice's last output: vLLM's spans


class FinishedChoice(NamedTuple):
    """One choice SGLang finished: what vLLM's output processor records for a finished engine request
    (vllm:request_success_total, the e2e, token and per-token histograms each count it once)."""

    reason: str  # vLLM's finish reason
    prompt_tokens: int
    generation_tokens: int


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None

    def body(self, drop_nulls: bool = False) -> dict:
        """vLLM's UsageInfo, in its key order; streams' usage chunks drop the nulls."""
        report = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": None if self.cached_tokens is None else {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": None,
        }
        return {k: v for k, v in report.items() if v is not None} if drop_nulls else report


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """Per-response facts every formatter needs besides the request and the outputs."""

    response_id: str
    created: int
    model: str
    prompt_ids: list[list[int]]  # per prompt (chat and generate have one)
