"""The fence: no rollout is served on weights other than the fleet's.

A watcher (a background task of the controller's admin plane; a follower runs none: ownership.py) reads
every worker's /model_info weight version every --fence-interval seconds (0.25 by default), stretched so
the whole fleet costs at most READS_PER_S reads a second, and at once when the data path sees a stale reply. A worker is FENCED when it
- reports a weight version other than the fleet's (and not one an update in flight is setting), e.g. a
  restarted SGLang back on "default" while the fleet serves 7; or
- does not answer (refused or 503: it died, or is restarting): it comes back with the weights it started on.
A fenced worker is paused (/pause_generation, mode abort: what it runs is on the wrong weights) and, behind
sglang-router, taken out of the router's list (router_list.py), so nothing reaches it. It stays an
admin-plane worker: a weight update reaches it.

It is HEALED:
- from disk, only when the checkpoint that holds the fleet's version is known (the plane's loaded_path): that
  checkpoint is loaded on the worker with the fleet's version (/update_weights_from_disk), the version
  verified (and the weights checksum against a healthy worker's, when the fleet's last update verified
  checksums); one this process did not load itself (read at start: start.py) is proven first (`prove`);
- otherwise (the weights came over NCCL, or the workers disagreed at start) it is HELD: it stays out,
  paused once (again only after a fleet /resume), named in /weight_info `fenced` and the
  token_proxy_fenced_workers gauge, until an update brings it to the fleet's version;
then it is let back in: continued (unless the whole fleet is paused: the fleet's /resume does it) and,
behind sglang-router, added back.
A worker that was only unreachable and comes back on the fleet's version is let back in at once when the
fleet still serves the weights SGLang starts with; otherwise it is healed as above.
The watcher stands aside while a weight update holds the fleet (transaction.py's lock), during a client's
own weight-update session, and while a failed update holds the fleet paused. A version this process never
set nor saw, appearing on a worker twice within ownership.py's FIGHT_WINDOW_S (`strike`), is another controller at work:
this one stands down (ownership.py's `stand_down`, one line) rather than undo it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from token_proxy.errors import BackendUnavailable
from token_proxy.fleet import router_list
from token_proxy.fleet import transaction as fleet
from token_proxy.fleet.flush import safe_flush, settle_refusals
from token_proxy.fleet.ownership import stand_down, strike
from token_proxy.fleet.plane import ADMIN, AdminPlane
from token_proxy.fleet.versions import register_reply_check
from token_proxy.sglang.workers import WorkerFailed, WorkerReply
from token_proxy.state import CONTEXT, REGISTER_COLLECTOR

log = logging.getLogger(__name__)

POLL_TIMEOUT_S = 2.0  # a /model_info slower than this is no verdict (a busy worker is not a dead one)
PAUSE_TIMEOUT_S = 10.0  # a worker that cannot pause in this long is out of the router's list anyway
HEAL_RETRY_S = 1.0
READS_PER_S = 32.0  # the idle fence's budget of /model_info reads over the whole fleet (issue 41 item 7)
UNREACHABLE = "unreachable"
FENCED, HEALED = "fenced", "healed"


@dataclass(slots=True)
class Fenced:
    url: str
    reason: str
    since: float = field(default_factory=time.monotonic)
    first_version: str | None = None  # what it reported when fenced (or first after coming back)
    came_back: bool = False  # it was unreachable, and answers again
    removed: bool = False  # out of sglang-router's list
    healing: bool = False
    held: bool = False  # no checkpoint is known to hold the fleet's version: out until the next update
    fleet_was_paused: bool = False  # at the last check (a held worker is paused again after a fleet /resume)
    last_error: str | None = None
    next_try: float = 0.0

    def as_dict(self) -> dict:
        out = {"url": self.url, "reason": self.reason, "removed_from_router": self.removed,
               "healing": self.healing, "fenced_for_s": round(time.monotonic() - self.since, 3)}
        if self.last_error:
            out["last_error"] = self.last_error
        return out


@dataclass
class Fence:
    plane: AdminPlane
    interval_s: float
    fenced: dict[str, Fenced] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=lambda: {FENCED: 0, HEALED: 0})
    tasks: set = field(default_factory=set)
    poked: asyncio.Event = field(default_factory=asyncio.Event)
    foreign: dict[str, str] = field(default_factory=dict)  # url -> the last version it showed that no one here set
    strikes: list[float] = field(default_factory=list)  # when such versions appeared (ownership.strike)

    # ---- the watcher

    async def run(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # the watcher outlives any one bad read
                log.exception("the fence's check failed")
            await self.wait_for_next()

    def period(self) -> float:
        """Seconds between idle reads of every worker: --fence-interval, stretched so that the whole fleet
        costs SGLang at most READS_PER_S reads a second (256 workers: every 8 s, 32 reads/s, not 1,024)."""
        return max(self.interval_s, len(self.plane.fleet_urls()) / READS_PER_S)

    async def wait_for_next(self) -> None:
        """The next read comes after period(), or at once (but never within --fence-interval of the last) when
        the data path saw a reply on weights the fleet does not serve: a restarted worker's first reply is
        sent again (never returned) and makes the fence read every worker, so it is fenced before it serves."""
        await asyncio.sleep(self.interval_s)
        if self.poked.is_set() or self.period() <= self.interval_s:
            self.poked.clear()
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.poked.wait(), self.period() - self.interval_s)
        self.poked.clear()

    def poke(self) -> None:
        self.poked.set()

    def standing_aside(self) -> bool:
        plane = self.plane
        return plane.control.lock.locked() or plane.control.client_session or plane.control.hold is not None

    async def check(self) -> None:
        """One read of every worker's version; fence what drifted, heal or hold what is fenced."""
        plane = self.plane
        if plane.weights.version is None or plane.stood_down is not None or self.standing_aside():
            return
        urls = await plane.worker_urls()  # the fleet's live view lists them again (sglang/fleet_view.py)
        fleet = plane.weights.version
        replies = await plane.fan_out("GET", "/model_info", None, POLL_TIMEOUT_S, urls)
        if self.standing_aside() or plane.weights.version != fleet:
            return  # an update began meanwhile: its versions are not drift
        record = plane.version_record()
        accepted = {fleet, *record.incoming}
        for reply in replies:
            url, version = reply.url, reply.weight_version
            entry = self.fenced.get(url)
            if _down(reply):
                if entry is None:
                    await self.fence(url, f"{UNREACHABLE}: {reply.message}", None)
                continue
            if version is None:
                continue  # no verdict (a timeout, or an SGLang without weight versions)
            came_back = entry is not None and entry.reason.startswith(UNREACHABLE)
            if version not in accepted and version not in plane.weights.known_versions and not came_back \
                    and strike(self, url, version):
                await stand_down(self, url, version)
                return
            if entry is None:
                if version not in accepted:
                    await self.fence(url, f"reports weight version {version!r}; the fleet serves {fleet!r}",
                                     version)
                continue
            if came_back and not entry.came_back:
                entry.came_back, entry.first_version = True, version
                plane.weights.known_versions.add(version)  # what it started on: a restart, not another controller
                entry.reason = f"restarted (was {entry.reason}); reports weight version {version!r}"
                if not (version == fleet and self._pristine(fleet)):  # else its weights are the fleet's
                    log.error("worker %s fenced: %s", url, entry.reason)
                    await self.pause(url)  # a restarted SGLang comes back unpaused
            if not entry.healing and time.monotonic() >= entry.next_try:
                self.heal_or_hold(entry, version, fleet)
            entry.fleet_was_paused = plane.control.paused

    async def fence(self, url: str, reason: str, version: str | None) -> None:
        entry = self.fenced[url] = Fenced(url, reason, first_version=version)
        self.plane.fenced.urls.add(url)
        self.events[FENCED] += 1
        self.plane.note_change()
        log.error("worker %s fenced: %s", url, reason)
        await self.pause(url)
        await self.take_out(entry)

    async def pause(self, url: str) -> None:
        (reply,) = await self.plane.fan_out("POST", "/pause_generation", {"mode": "abort"},
                                            min(self.plane.settings.admin_timeout_s, PAUSE_TIMEOUT_S), [url])
        if not reply.ok and not _down(reply):
            log.warning("fence: cannot pause %s: %s", url, reply.message)

    # ---- healing

    def heal_or_hold(self, entry: Fenced, version: str, fleet: str) -> None:
        plane = self.plane
        if version == fleet and (entry.first_version != fleet or (entry.came_back and self._pristine(fleet))
                                 or self._pushed_since(entry.since)):
            self._spawn(entry, self.let_in(entry))  # an update brought it to the fleet's weights
        elif plane.weights.loaded_path is not None:
            self._spawn(entry, self.heal_from_disk(entry))
        elif entry.held:
            if entry.fleet_was_paused and not plane.control.paused:  # a fleet /resume (forwarded or not) continued it
                self._spawn(entry, self.pause(entry.url))
        else:  # no checkpoint holds the fleet's version: out (paused) until the next update
            entry.held = True
            log.error("worker %s held: no checkpoint is known to hold the fleet's version %r (it came over NCCL, "
                      "or the workers disagreed at start); it stays fenced until the next weight update", entry.url,
                      fleet)

    def _pristine(self, fleet: str) -> bool:
        """The fleet serves the weights SGLang starts with (what a restarted worker comes back on)."""
        plane = self.plane
        return plane.weights.loaded_path == plane.weights.base_model_path and fleet == plane.weights.initial_version

    def _pushed_since(self, since: float) -> bool:
        step = self.plane.push.last_step
        return step is not None and step.ok and step.finished_at > since

    def _spawn(self, entry: Fenced, work) -> None:
        entry.healing = True  # before the task runs: the next check must not start another

        async def run():
            try:
                await work
            except Exception as exc:  # noqa: BLE001 (tried again after HEAL_RETRY_S)
                entry.last_error = str(exc)
                log.warning("fence: healing %s failed: %s", entry.url, exc)
            finally:
                entry.healing = False
                entry.next_try = time.monotonic() + HEAL_RETRY_S

        task = asyncio.get_running_loop().create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def heal_from_disk(self, entry: Fenced) -> None:
        """The fleet's checkpoint on the fenced worker, as the fleet's version; verified; then let in. A
        checkpoint this process did not load itself (read at start) is loaded under a label that says so,
        proven by its weights checksum against a healthy worker's, and only then labelled the fleet's."""
        plane, url = self.plane, entry.url
        async with plane.control.lock:  # one weight update at a time (fleet.py)
            path, version = plane.weights.loaded_path, plane.weights.version
            if path is None or version is None or plane.stood_down is not None:
                return
            proven = plane.weights.checkpoint_proven
            label = version if proven else f"{version}?unproven:{path}"
            log.warning("fence: healing %s from %s (version %s%s)", url, path, version,
                        "" if proven else ", to be proven by checksum first")
            body = {"model_path": path, "flush_cache": True, "weight_version": label}
            (flushable,) = await safe_flush(plane, [body], [url])
            (reply,) = await plane.fan_out("POST", "/update_weights_from_disk", flushable,
                                           plane.settings.weight_update_timeout_s, [url])
            (reply,) = await settle_refusals(plane, [reply], version)
            if not reply.ok:
                entry.last_error = f"reload refused: {reply.message}"
                return
            if not proven and not await self.prove(entry, path, version, label):
                return
            error = await self.verify(url, version)
            if error:
                entry.last_error = error
                return
            await self.let_in(entry)

    async def prove(self, entry: Fenced, path: str, version: str, label: str) -> bool:
        """The checkpoint read at start holds the fleet's version when the healed worker's weights checksum
        equals a healthy worker's: then it is labelled the fleet's version; otherwise the checkpoint is
        forgotten (never used to label again) and the worker held until the next update."""
        plane, url = self.plane, entry.url
        healthy = [u for u in await plane.worker_urls() if u not in self.fenced][:1]
        try:
            sums = await fleet.read_checksums(plane, [url, *healthy]) if healthy else {}
        except WorkerFailed as exc:
            sums, entry.last_error = {}, exc.message
        if not healthy or sums.get(url) is None or sums.get(url) != sums.get(healthy[0]):
            why = (f"its weights checksum differs from {healthy[0]}'s" if healthy and sums.get(url) is not None
                   else "no healthy worker's weights checksum to compare with")
            log.error("fence: %s does not provably hold version %r (%s): %s stays fenced under the label %r "
                      "until the next weight update", path, version, why, url, label)
            plane.weights.loaded_path = None
            entry.last_error, entry.held = f"{path} does not provably hold version {version!r}: {why}", True
            return False
        (reply,) = await plane.fan_out("POST", "/update_weight_version", {"new_version": version},
                                       plane.settings.admin_timeout_s, [url])
        if not reply.ok:
            entry.last_error = f"relabel refused: {reply.message}"
            return False
        plane.weights.checkpoint_proven = True
        return True

    async def verify(self, url: str, version: str) -> str | None:
        plane = self.plane
        reported = (await fleet.read_versions(plane, [url])).get(url)
        if reported != version:
            return f"reports weight version {reported!r} after the reload, not {version!r}"
        if not plane.weights.checksum_verified:
            return None
        healthy = [u for u in await plane.worker_urls() if u not in self.fenced][:1]
        sums = await fleet.read_checksums(plane, [url, *healthy])
        if healthy and sums.get(url) != sums.get(healthy[0]):
            return f"weights checksum {sums.get(url)} differs from {healthy[0]}'s {sums.get(healthy[0])}"
        return None

    async def let_in(self, entry: Fenced) -> None:
        plane, url = self.plane, entry.url
        if not plane.control.paused:
            (reply,) = await plane.fan_out("POST", "/continue_generation", {}, plane.settings.admin_timeout_s, [url])
            if not reply.ok:
                raise RuntimeError(f"continue_generation: {reply.message}")
        if entry.removed:
            await self.put_back(entry)
        self.fenced.pop(url, None)
        plane.fenced.urls.discard(url)
        self.events[HEALED] += 1
        plane.note_change()
        log.warning("worker %s healed: back in the fleet at version %s", url, plane.weights.version)

    # ---- sglang-router's list

    async def take_out(self, entry: Fenced) -> None:
        removed = await router_list.remove(self.plane.workers.client, entry.url)
        if isinstance(removed, str):
            log.error("fence: %s", removed)
        elif removed:
            entry.removed = True
            self.plane.fenced.router_removed[entry.url] = None

    async def put_back(self, entry: Fenced) -> None:
        error = await router_list.add(self.plane.workers.client, entry.url)
        if error:
            raise RuntimeError(error)
        entry.removed = False
        self.plane.fenced.router_removed.pop(entry.url, None)

    def info(self) -> list[dict]:
        return [entry.as_dict() for entry in self.fenced.values()]


def _down(reply: WorkerReply) -> bool:
    return isinstance(reply.error, BackendUnavailable) or reply.status == 503


class FenceCollector:
    """token_proxy_fenced_workers{url,reason} (1 per worker kept out) and token_proxy_fence_events_total{event}."""

    def __init__(self, fence: Fence):
        self.fence = fence

    def collect(self):
        gauge = GaugeMetricFamily("token_proxy_fenced_workers", "Workers kept out of the fleet now (paused, and "
                                  "out of sglang-router's list) until healed, with why", labels=["url", "reason"])
        for entry in self.fence.fenced.values():
            gauge.add_metric([entry.url, entry.reason], 1)
        events = CounterMetricFamily("token_proxy_fence_events", "Workers fenced (restarted, unreachable or on "
                                     "another weight version) and healed (back in the fleet)", labels=["event"])
        for event, count in self.fence.events.items():
            events.add_metric([event], count)
        yield gauge
        yield events


FENCE: web.AppKey[Fence] = web.AppKey("fence", Fence)


def fence_info(app: web.Application) -> dict:
    """/weight_info's `fenced`: each worker kept out, and why."""
    fence = app.get(FENCE)
    return {"fenced": fence.info() if fence is not None else []}


def add_fence(app: web.Application) -> None:
    """After the admin plane's state (its cleanup context makes the plane)."""
    app.cleanup_ctx.append(_fence)


async def _fence(app: web.Application):
    plane = app[ADMIN]
    settings = plane.settings
    register_reply_check(app, plane.board)
    if settings.fleet_controller:  # a follower never fences or heals (ownership.py mirrors the record)
        yield
        return
    fence = app[FENCE] = Fence(plane, settings.fence_interval_s)
    plane.board.on_stale = fence.poke
    if REGISTER_COLLECTOR in app:
        app[REGISTER_COLLECTOR](FenceCollector(fence))
    app[CONTEXT].when_ready(lambda backend: plane.note_change())  # the version learnt at start-up
    task = None
    if settings.fence_interval_s > 0:
        task = asyncio.get_running_loop().create_task(fence.run())
    yield
    await plane.joins.close()
    for pending in [task, *fence.tasks]:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
