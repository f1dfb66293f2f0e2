"""Everything a running simulator knows, kept on the aiohttp Application (no module globals)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from aiohttp import web
from tokenizers import Tokenizer

from token_proxy.simulator.config import SimConfig
from token_proxy.simulator.generate_request import GenerateCall
from token_proxy.simulator.lora import SimLora, weight_key
from token_proxy.simulator.prefix_cache import PrefixCache
from token_proxy.simulator.sequence import Sequence
from token_proxy.simulator.vocab import Vocab


@dataclass
class Counters:
    """Totals behind /metrics."""

    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (what replies report)
    aborted: int = 0


MAX_RECEIVED = 1024  # /generate bodies kept for tests to inspect; a long run must not grow without bound


class RecentList(list):
    """A list that keeps only its last `limit` items (dropping the oldest half at a time: amortised O(1))."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def append(self, item) -> None:
        super().append(item)
        if len(self) > self.limit:
            del self[: len(self) - self.limit // 2]


@dataclass
class SimState:
    config: SimConfig
    vocab: Vocab
    tokenizer: Tokenizer
    weight_version: str
    weights_path: str  # the last path weights were loaded from; part of what the fake model hashes
    received: list[dict] = field(default_factory=lambda: RecentList(MAX_RECEIVED))  # the latest /generate bodies
    running: dict[str, Sequence] = field(default_factory=dict)  # rid -> in-flight sequence
    aborted: list[str] = field(default_factory=list)  # rids aborted (abort_request, pause, disconnect)
    loaded_from: str | None = None  # the last checkpoint loaded from disk (/model_info's model_path)
    on_disk_load: list = field(default_factory=list)  # weight_routes.py: the tensors back to the checkpoint's
    crashed: bool = False
    paused: bool = False
    pause_mode: str | None = None
    updating_weights: bool = False
    # The call the scheduler is stuck in (a weight-update group join: scheduler_block.py), or None.
    blocked: str | None = None
    prefix_cache: PrefixCache = field(default_factory=PrefixCache)
    counters: Counters = field(default_factory=Counters)
    lora: SimLora = field(default_factory=SimLora)  # loaded LoRA adapters
    metric_overrides: dict[str, float] = field(default_factory=dict)  # pinned by simulator/metrics.py
    rng: random.Random = field(default_factory=random.Random)
    started_at: float = field(default_factory=time.time)
    active: int = 0  # sequences past admission (prefilled) and not yet released
    _waiters: list[asyncio.Future] = field(default_factory=list)

    @property
    def weight_key(self) -> str:
        return f"{self.weight_version}\0{self.weights_path}"

    @property
    def may_admit(self) -> bool:
        """New requests wait while paused, while weights are swapped (SGLang's writer lock), while the
        scheduler is blocked, and beyond max_running_requests; running ones stop for a pause or a block."""
        limit = self.config.max_running_requests
        return not (self.paused or self.updating_weights or self.blocked is not None
                    or (limit and self.active >= limit))

    def changed(self) -> asyncio.Future:
        """A future resolved at the next pause/continue/abort/release, for waiters to re-check."""
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        return future

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(None)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def admit(self, call: GenerateCall, received: float) -> list[Sequence]:
        sequences = [
            Sequence(spec, self.vocab, self.config.eos_token_ids, self.rng, received)
            for spec in call.sequences
        ]
        for sequence in sequences:
            self.running[sequence.rid] = sequence
        self.counters.requests += len(sequences)
        return sequences

    def start(self, sequence: Sequence, warm_prefix: bool) -> None:
        prompt, key = sequence.spec.prompt, sequence.spec.extra_key
        if warm_prefix:  # n > 1: SGLang prefills the shared prompt once before the children
            self.prefix_cache.insert(prompt, key)
        sequence.start(weight_key(self.weight_key, sequence.spec.lora), self.prefix_cache.match(prompt, key))
        self.active += 1
        self.prefix_cache.insert(prompt, key)
        self.counters.prompt_tokens += len(prompt)
        self.counters.cached_tokens += sequence.cached_tokens

    def release(self, sequence: Sequence) -> None:
        """The sequence is done (or its client left): stop tracking it. Idempotent."""
        if self.running.pop(sequence.rid, None) is None:
            return
        self.active -= sequence.started
        self.notify()
        if not sequence.finished:
            sequence.abort()
        if sequence.finish_reason is not None and sequence.finish_reason.get("message") == "Aborted":
            self.aborted.append(sequence.rid)
            self.counters.aborted += 1
        self.counters.generation_tokens += len(sequence.output_ids)
        if sequence.started:
            self.prefix_cache.insert(sequence.spec.prompt + sequence.output_ids, sequence.spec.extra_key)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """TokenizerManager.abort_request: an exact rid (or an n>1 parent) aborts every
        running rid it prefixes, as SGLang's scheduler matches with startswith."""
        if abort_all:
            targets = list(self.running.values())
        elif rid and any(s.rid == rid or s.spec.logical_rid == rid for s in self.running.values()):
            targets = [s for s in self.running.values() if s.rid.startswith(rid)]
        else:
            targets = []
        for sequence in targets:
            sequence.abort_requested = True
        self.notify()
        return len(targets)


SIM_STATE: web.AppKey[SimState] = web.AppKey("sim_state", SimState)
