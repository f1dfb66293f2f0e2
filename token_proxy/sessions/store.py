"""Per-session turns, bounded by count (LRU), idle time (TTL) and bytes; one store per process.

`prompt_ids` and `record` are synchronous and thread-safe; the chat path runs both in its tokenizer
executor (`prompt_ids_async`, `record_soon`): they render, tokenize, decode and serialise, which must
stay off the event loop. The lock only guards the dict; that work happens outside it.

A record runs after the response is built (for a stream, after its last chunk), so the client may send
the next turn before it lands: `prompt_ids_async` first waits for the records already under way, so a
lookup sees every turn whose response came before it (and the evictions those records caused).

With several worker processes each has its own store: a request that lands on a worker which did not
serve the previous turn is an `unknown_session` fallback (rendered in full, reported and counted).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from array import array
from collections import Counter, OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass, field

import orjson

from token_proxy.sessions.codec import ChatCodec, digest_text
from token_proxy.sessions.continuation import Rendering, Turn, continue_turn, generation_prompt, rendering_of
from token_proxy.sessions.outcome import Fallback, SessionOutcome

log = logging.getLogger(__name__)

_TURN_OVERHEAD_BYTES = 400  # the record, its arrays' headers, digests and the dict slot


@dataclass
class SessionStats:
    hits: int = 0
    divergent_hits: int = 0  # hits whose template renders the previous turn differently
    fallbacks: Counter = field(default_factory=Counter)  # reason value -> count
    evictions: Counter = field(default_factory=Counter)  # "lru" | "ttl" | "bytes" -> count
    reused_tokens: int = 0
    tokenized_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """The prompt for one request in a session, and what `record` needs afterwards."""

    key: str
    ids: list[int]
    outcome: SessionOutcome
    rendering: Rendering | None  # None: nothing to record (unsupported request)
    codec: ChatCodec


class SessionStore:
    def __init__(self, max_sessions: int = 10_000, ttl_s: float = 600.0, max_bytes: int = 256 << 20,
                 clock=time.monotonic):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self.stats = SessionStats()
        self.nbytes = 0
        self._turns: OrderedDict[str, tuple[float, Turn]] = OrderedDict()  # key -> (last use, turn)
        self._gen_prompts: OrderedDict[bytes, str] = OrderedDict()  # tools + template digest -> prompt
        self._lock = threading.Lock()
        self._recording: set[asyncio.Future] = set()  # records under way in the executor (event-loop side)

    def __len__(self) -> int:
        return len(self._turns)

    def prompt_ids(self, key: str, messages: list[dict], codec: ChatCodec) -> SessionPlan:
        """Prompt ids for `messages` in session `key`: continued from the stored turn, or rendered in full."""
        if not codec.supported:
            return self._fallback(key, codec, codec.render_requested(messages), Fallback.UNSUPPORTED_REQUEST, None)
        full = codec.render(messages, True)
        rendering = rendering_of(messages, full, codec, self._generation_prompt(codec))
        turn = self._get(key)
        found = Fallback.UNKNOWN_SESSION if turn is None else continue_turn(turn, messages, full, codec)
        if isinstance(found, Fallback):
            return self._fallback(key, codec, full, found, rendering)
        suffix, divergence = found
        new_ids = codec.encode(suffix, False)
        ids = [*turn.prompt_ids, *turn.completion_ids, *new_ids]
        outcome = SessionOutcome.hit(len(ids) - len(new_ids), len(new_ids), divergence)
        with self._lock:
            self.stats.hits += 1
            self.stats.divergent_hits += divergence is not None
            self.stats.reused_tokens += outcome.reused_tokens
            self.stats.tokenized_tokens += len(new_ids)
        return SessionPlan(key, ids, outcome, rendering, codec)

    async def prompt_ids_async(self, executor: Executor | None, key: str, messages: list[dict],
                               codec: ChatCodec) -> SessionPlan:
        """`prompt_ids` in the tokenizer executor (it renders and tokenizes; keep it off the event loop),
        after the records already under way (a client may send turn k+1 as soon as turn k's stream ends)."""
        if self._recording:
            await asyncio.wait(set(self._recording))
        return await asyncio.get_running_loop().run_in_executor(executor, self.prompt_ids, key, messages, codec)

    def record(self, plan: SessionPlan, completion_ids: list[int], finish_reason: str, reply: dict) -> None:
        """Remember what the model produced for `plan` and the assistant message the client got.

        Call it for a finished single-choice request (finish_reason "stop", "length" or "tool_calls");
        an aborted or failed request leaves the previous turn in place.
        """
        if plan.rendering is None:
            return
        turn = _turn(plan, completion_ids, finish_reason, reply)
        with self._lock:
            self._drop(plan.key, None)
            if turn.nbytes > self.max_bytes:
                self.stats.evictions["bytes"] += 1
                return
            self._turns[plan.key] = (self.clock(), turn)
            self.nbytes += turn.nbytes
            self._evict()

    def record_soon(self, executor: Executor | None, plan: SessionPlan, completion_ids: list[int],
                    finish_reason: str, reply: dict) -> None:
        """`record` in the tokenizer executor (it decodes the whole completion and serialises the reply);
        the next `prompt_ids_async` waits for it. Call it on the event loop."""
        if plan.rendering is None:
            return
        future = asyncio.get_running_loop().run_in_executor(executor, self.record, plan, completion_ids,
                                                            finish_reason, reply)
        self._recording.add(future)
        future.add_done_callback(self._recorded)

    def _recorded(self, future: asyncio.Future) -> None:
        self._recording.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.error("session turn not recorded", exc_info=future.exception())

    def forget(self, key: str) -> bool:
        """Drop the session's stored turn; False if none was held."""
        with self._lock:
            return self._drop(key, None)

    def _fallback(self, key: str, codec: ChatCodec, full: str, reason: Fallback,
                  rendering: Rendering | None) -> SessionPlan:
        ids = codec.encode(full, codec.add_special_tokens)
        with self._lock:
            self.stats.fallbacks[reason.value] += 1
            self.stats.tokenized_tokens += len(ids)
        return SessionPlan(key, ids, SessionOutcome.fallback(reason, len(ids)), rendering, codec)

    def _generation_prompt(self, codec: ChatCodec) -> str:
        key = codec.tools_key + codec.template_key
        found = self._gen_prompts.get(key)
        if found is None:
            found = generation_prompt(codec)
            with self._lock:
                self._gen_prompts[key] = found
                while len(self._gen_prompts) > 256:
                    self._gen_prompts.popitem(last=False)
        return found

    def _get(self, key: str) -> Turn | None:
        with self._lock:
            entry = self._turns.get(key)
            if entry is None:
                return None
            now = self.clock()
            if now - entry[0] > self.ttl_s:
                self._drop(key, "ttl")
                return None
            self._turns[key] = (now, entry[1])
            self._turns.move_to_end(key)
            return entry[1]

    def _evict(self) -> None:
        now = self.clock()
        while self._turns:
            key, (last_use, _) = next(iter(self._turns.items()))
            if now - last_use > self.ttl_s:
                self._drop(key, "ttl")
            elif len(self._turns) > self.max_sessions:
                self._drop(key, "lru")
            elif self.nbytes > self.max_bytes:
                self._drop(key, "bytes")
            else:
                return

    def _drop(self, key: str, cause: str | None) -> bool:
        entry = self._turns.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[1].nbytes
            if cause:
                self.stats.evictions[cause] += 1
        return entry is not None


def _turn(plan: SessionPlan, completion_ids: list[int], finish_reason: str, reply: dict) -> Turn:
    codec = plan.codec
    text = codec.decode(completion_ids)
    stop_text = codec.special_text(completion_ids[-1]) if completion_ids and finish_reason != "length" else None
    reply = dict(reply)
    prompt, completion = array("i", plan.ids), array("i", completion_ids)
    nbytes = (prompt.itemsize * (len(prompt) + len(completion)) + len(orjson.dumps(reply, default=str))
              + len(plan.rendering.gen_prompt or "") + _TURN_OVERHEAD_BYTES)
    return Turn(plan.rendering, prompt, completion, len(text), digest_text(text), stop_text, finish_reason,
                reply, nbytes)
