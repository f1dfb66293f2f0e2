"""The admin plane: the workers' fan-out it holds (sglang/workers.py) and the fleet's state in named parts:
the version record (WeightRecord), the transaction's lock, pause and hold (FleetControl), the fence's marks
(FenceMarks) and the NCCL steps (NcclPush); besides them the prefix-cache flushes owed and the stand-down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from token_proxy.errors import BackendTimeout, InvalidRequest
from token_proxy.fleet import joins as group_joins
from token_proxy.fleet.joins import Joins
from token_proxy.fleet.start import start_state
from token_proxy.fleet.versions import VersionBoard, VersionRecord
from token_proxy.long_poll import Publication
from token_proxy.settings import Settings
from token_proxy.sglang.picture import BackendInfo
from token_proxy.sglang.workers import WorkerReply, Workers

# How long after a call that sets a weight version ends its version stays accepted on the data path while
# the proxy records the outcome.
INCOMING_GRACE_S = 10.0
SGLANG_START_VERSION = "default"  # SGLang's --weight-version default: what a restarted or reset worker reports

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 30.0


@dataclass(slots=True)
class StepResult:
    """The outcome of one NCCL weight push (its last bucket carries the weight version)."""

    ok: bool
    message: str
    version: str | None
    status: int = 200  # what a failed push answers (fleet.push_status: 503 when a new join + push would work)
    finished_at: float = field(default_factory=time.monotonic)
    consumed: bool = False  # an /update_weights {"weight_dir": null} answered for it (each push answers once)


@dataclass
class WeightRecord:
    """What the workers hold: the version the proxy last set on every worker, where it came from, and every
    version it has seen (written by the plane's record_version / learn_start and the transaction)."""

    base_model_path: str | None = None  # what /reload_weights goes back to
    initial_version: str | None = None
    version: str | None = None
    # The proxy's own record of version changes: (monotonic time, version), oldest first.
    history: list[tuple[float, str]] = field(default_factory=list)
    # Every weight version this process set, saw at start or saw an update of its own move to: a worker on
    # any other version (and not back from a restart) was updated by another process (fence.py's stand-down).
    known_versions: set[str] = field(default_factory=lambda: {SGLANG_START_VERSION})
    # The checkpoint the workers hold now (what a failed fleet update rolls back to), and whether this
    # process loaded it as the fleet's version itself (proven) or read it at start (fence.py proves it by
    # checksum before a heal labels anything with it). None: no checkpoint is known to hold the weights.
    loaded_path: str | None = None
    checkpoint_proven: bool = False
    checksum_verified: bool = False  # the last disk update verified checksums (a heal verifies the same way)
    # The versions calls in flight are setting (the data path accepts them: pipeline/reply_check.py).
    incoming: dict[str, float] = field(default_factory=dict)


@dataclass
class FleetControl:
    """The transaction's state (transaction.py): one weight update at a time, the fleet's pause, and the
    hold a failed update leaves."""

    # One weight update at a time: a second waits for the first; /resume meanwhile is a 409.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    updating: bool = False
    started: float | None = None  # monotonic start of the running update transaction
    paused: bool = False  # the last pause / continue through the proxy (SGLang cannot be asked)
    # A failed fleet update the proxy could not undo: the fleet stays paused until it is fixed.
    hold: dict | None = None
    # A client opened SGLang's weight-update session itself (POST /begin_weight_update through the proxy):
    # the proxy's own bracket stands aside until the client's /end_weight_update (weight_session.py).
    client_session: bool = False


@dataclass
class FenceMarks:
    """What the fence (fence.py) keeps: the workers it keeps out (a fleet /resume leaves them paused; the
    data path's 503 reads them), those it took out of sglang-router's list (still admin-plane workers: a
    weight update reaches them) and each worker's version as last read or set. Which workers there are is
    the fleet's live view (AdminPlane.fleet_urls)."""

    urls: set[str] = field(default_factory=set)
    router_removed: dict[str, None] = field(default_factory=dict)
    worker_versions: dict[str, str | None] = field(default_factory=dict)  # url -> version


@dataclass
class NcclPush:
    """The NCCL weight steps: the groups joined through the proxy (a step without one can never arrive),
    the last push's outcome, and whether one is half landed."""

    live_groups: set[str] = field(default_factory=set)
    last_step: StepResult | None = None
    # Buckets of an NCCL push landed, its last (the one with the weight version) not yet: a push that is
    # abandoned now leaves partial weights (routes.py holds the fleet when its wait runs out).
    open: bool = False
    paused_at: float = 0.0  # the last /pause: a push answers the calls made after it
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def publish(self, result: StepResult) -> None:
        self.last_step = result
        self.arrived.set()

    def waiting(self) -> bool:
        """A push ended since the last /pause that no call has answered for yet (it may have failed and
        destroyed its group: its answer is still owed)."""
        step = self.last_step
        return step is not None and step.finished_at >= self.paused_at and not step.consumed

    async def next_step(self, timeout_s: float) -> StepResult:
        """The first NCCL push that ended after the last /pause (prime-rl pauses, then pushes) and that no
        earlier call answered for: each push answers one /update_weights, so a repeat (an HTTP retry, or a
        call without a new /pause) waits for a new push instead of returning the last one's result."""
        deadline = time.monotonic() + timeout_s
        while self.last_step is None or self.last_step.finished_at < self.paused_at or self.last_step.consumed:
            self.arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackendTimeout(
                    f"no weight broadcast reached the workers within {timeout_s:g} s: in NCCL mode the "
                    "trainer's broadcaster sends the tensors with /update_weights_from_distributed "
                    "through this proxy (see README, Weight updates)" + self._answered_note())
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except asyncio.TimeoutError:
                continue
        self.last_step.consumed = True
        return self.last_step

    def _answered_note(self) -> str:
        step = self.last_step
        if step is None or not step.consumed or step.finished_at < self.paused_at:
            return ""
        outcome = f"version {step.version}" if step.ok else "failed"
        return (f"; the last push ({outcome}) was already answered by an earlier /update_weights: each call "
                "answers for one push that it waited for")


@dataclass(kw_only=True)
class AdminPlane:
    """The admin plane: the workers' fan-out (sglang/workers.py) and the fleet's state in named parts."""

    settings: Settings
    workers: Workers
    # SGLang's calls that set a weight version: path -> the key of their body that names it (the route
    # table's `version_key`, routes.py).
    version_keys: Mapping[str, str]
    weights: WeightRecord = field(default_factory=WeightRecord)
    control: FleetControl = field(default_factory=FleetControl)
    fenced: FenceMarks = field(default_factory=FenceMarks)
    push: NcclPush = field(default_factory=NcclPush)
    joins: Joins = field(default_factory=Joins)  # weight-update group joins SGLang has not answered (joins.py)
    # Workers that updated weights without flushing their prefix cache (flush.py says why).
    owed_flushes: set[str] = field(default_factory=set)
    # Set once another process is found updating these workers' weights: this one stops acting (ownership.py).
    stood_down: str | None = None
    # What the fleet's live view (sglang/fleet_view.py, whose snapshot the data path reads) knows of a worker,
    # or None: the plane reads the fleet's facts there instead of keeping a copy (weight_session.py).
    facts: Callable[[str], BackendInfo | None] = field(init=False)
    # Run after every weight update or version change through the admin plane (record_version): the
    # proxy's metrics re-read the version SGLang serves (ops/backend_scrape.py registers it).
    after_weights: list[Callable[[], None]] = field(default_factory=list)
    # Bumped whenever what the data path accepts changes (a --workers mirror and a follower poll it).
    news: Publication = field(default_factory=lambda: Publication("the fleet's version record"))
    board: VersionBoard = field(default_factory=VersionBoard)  # what this process's data path reads

    def __post_init__(self) -> None:
        self.workers.also_reach = lambda: list(self.fenced.router_removed)
        self.facts = self.workers.fleet.facts

    def fleet_urls(self) -> list[str]:
        """Every worker the fleet has: the live view's last list, and those the fence took out of the router's."""
        urls = list(self.workers.last_urls)
        return urls + [url for url in self.fenced.router_removed if url not in urls]

    async def worker_urls(self) -> list[str]:
        return await self.workers.worker_urls()

    async def fan_out(self, method: str, path: str, bodies: list[dict] | dict | bytes | None,
                      timeout_s: float, urls: list[str] | None = None) -> list[WorkerReply]:
        """Workers.fan_out; a call that sets a weight version marks that version incoming meanwhile; a group
        join is watched (joins.py: answered within `timeout_s`, its worker named until SGLang answers)."""
        if path == group_joins.JOIN_PATH:
            return await group_joins.join(self, method, bodies, timeout_s, urls)
        with self._setting_versions(path, bodies):
            return await self.workers.fan_out(method, path, bodies, timeout_s, urls)

    async def fan_out_until_failure(self, method: str, path: str, bodies: list[dict] | dict | bytes | None,
                                    timeout_s: float, urls: list[str]) -> list[WorkerReply]:
        """Workers.fan_out_until_failure (an NCCL push's bucket), its version marked incoming the same way: a
        worker that took the last bucket reports the new version before the others and before the proxy
        records it, and the fence must not take that for drift."""
        with self._setting_versions(path, bodies):
            return await self.workers.fan_out_until_failure(method, path, bodies, timeout_s, urls)

    @contextlib.contextmanager
    def _setting_versions(self, path: str, bodies):
        """The versions a call's bodies set (its row's version_key): incoming while it runs, and for
        INCOMING_GRACE_S after (a worker that answered late may still be on its way)."""
        key = self.version_keys.get(path.split("?", 1)[0])
        targets = _targets(bodies, key) if key else set()
        for version in targets:
            self.weights.incoming[version] = math.inf
        self.weights.known_versions |= targets
        if targets:
            self.note_change()
        try:
            yield
        finally:
            if targets:
                until = time.monotonic() + INCOMING_GRACE_S
                for version in targets:
                    self.weights.incoming[version] = until
                self.note_change()

    def version_record(self) -> VersionRecord:
        if self.settings.fleet_controller:  # a follower: the controller's record, as ownership.py mirrors it
            return self.board.record
        now, weights = time.monotonic(), self.weights
        for version in [v for v, until in weights.incoming.items() if until < now]:
            del weights.incoming[version]
        if self.stood_down is not None:  # another process owns the weights: this one judges no reply
            return VersionRecord(None, None, [], {}, unavailable=None)
        return VersionRecord(weights.version, weights.initial_version, list(weights.history),
                             dict(weights.incoming), unavailable=self.unavailable(), joining=self.joining())

    def unavailable(self) -> str | None:
        """Why no worker can serve a chat now (the data path answers a prompt 503), or None."""
        if self.control.hold is not None:
            return "the workers are held paused after a failed weight update (GET /weight_info says why)"
        fenced = self.fenced.urls
        if fenced and (set(self.fleet_urls()) <= fenced or self.settings.backend_url in fenced):
            return ("no healthy worker: every worker the data path reaches is fenced until healed (GET "
                    "/weight_info names them)")
        return self.joining()

    def joining(self) -> str | None:
        """Why every worker the data path reaches (and is not fenced) is blocked in a group join, or None."""
        if not self.joins.open:
            return None
        if self.settings.backend_url in self.joins.open:
            return self.joins.blocking({self.settings.backend_url})
        return self.joins.blocking(set(self.fleet_urls()) - self.fenced.urls)

    def note_change(self) -> None:
        if not self.settings.fleet_controller:
            self.board.record = self.version_record()
        self.news.bump()

    @contextlib.asynccontextmanager
    async def transaction(self):
        """Hold the fleet for one weight update (or sleep / wake-up / group join) from start to end. A long one
        says it is still running every PROGRESS_EVERY_S (as vLLM logs a long load). A process that stood down
        (another one owns these workers' weights) refuses (409)."""
        if self.stood_down is not None:
            raise StoodDown(self.stood_down)
        control = self.control
        async with control.lock:
            control.updating, control.started = True, time.monotonic()
            progress = asyncio.get_running_loop().create_task(self._progress(control.started))
            try:
                yield
            finally:
                progress.cancel()
                control.updating, control.started = False, None

    async def _progress(self, started: float) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            log.info("weight update still running after %.0f s (fleet at version %s)", time.monotonic() - started,
                     self.weights.version)

    def learn_start(self, backend, workers: Mapping[str, object]) -> None:
        """Once SGLang is known: the fleet's weights by start.py's rule over every worker's /model_info."""
        pairs = [(url, info.model_path, info.weight_version) for url, info in workers.items()] or [
            ("", backend.model_path, backend.weight_version)]
        state = start_state(pairs)
        weights = self.weights
        weights.base_model_path = backend.model_path
        weights.loaded_path, weights.checkpoint_proven = state.checkpoint, False
        weights.initial_version = weights.version = state.version
        weights.known_versions |= state.seen
        if state.note:
            log.warning("%s", state.note)
        self.note_change()

    def mark_paused(self) -> None:
        """Every worker is paused now (through the proxy)."""
        self.push.paused_at = time.monotonic()
        self.control.paused = True

    def record_version(self, version: str | None) -> None:
        """Every worker serves `version` now: one line per change, with the workers and how long the update
        took (a weight update is otherwise silent, --disable-log-requests or not); then the after_weights
        hooks run (also for an update that named no version)."""
        weights, started = self.weights, self.control.started
        if version is not None and version != weights.version:
            took = f" in {time.monotonic() - started:.1f} s" if started is not None else ""
            log.info("weights updated to version %s on %s%s (was %s)", version,
                     ", ".join(self.workers.last_urls) or "every worker", took, weights.version)
            weights.version = version
            weights.known_versions.add(version)
            weights.history.append((time.monotonic(), version))
            self.note_change()
        for hook in self.after_weights:
            hook()


class StoodDown(InvalidRequest):
    """Another process updates these workers' weights: this one no longer does (fence.py found it)."""

    status = 409
    type = "ConflictError"


def _targets(bodies, key: str) -> set[str]:
    """The weight versions a call's bodies set (raw bytes are a forwarded JSON body)."""
    out = set()
    for body in bodies if isinstance(bodies, list) else [bodies]:
        if isinstance(body, bytes):
            try:
                body = orjson.loads(body)
            except orjson.JSONDecodeError:
                continue
        if isinstance(body, dict) and body.get(key) is not None:
            out.add(str(body[key]))
    return out


ADMIN: web.AppKey[AdminPlane] = web.AppKey("admin_plane", AdminPlane)
