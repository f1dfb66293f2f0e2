"""Fleet-consistent weight updates: every worker behind the proxy moves to a new version together, or none
goes on serving a different one.

One transaction (a weight_dir given to prime-rl's /update_weights, /reload_weights):
pause every worker (unless the client paused them already) -> update every worker -> verify each worker
reports the new version on /model_info (and, when asked, that all report one weights checksum on SGLang's
/weights_checker) -> flush (the update's own flush, or the deferred one flush.py owes) -> resume (only what
this transaction paused).

When a worker fails (refuses, times out, restarts mid-update), the policy is ROLL BACK, ELSE HOLD:
- Roll back: reload the checkpoint the fleet held before (the last directory loaded through the proxy, else
  the model SGLang started with) on every worker not confirmed at the old version, and verify again. A worker
  that timed out is rolled back too: SGLang runs weight updates one at a time, so the rollback lands after
  its late update. When every worker reports the old version, the fleet serves on as before; the reply is
  an error (`outcome: rolled_back`) with each worker's result.
- Hold: with no previous checkpoint on disk (the fleet's weights came over NCCL) or a rollback that fails,
  every worker is paused again (a restarted one comes back unpaused) and stays paused: /resume answers 409
  naming each worker and its version until an update brings every worker to one version, or a caller
  forces it with /resume?force=true. The reply says `outcome: held_paused`.
A failed or abandoned NCCL push (every dialect) ends in push_failed: its group destroyed on every worker,
then rolled back or held as above (the workers hold partial weights), with 503 when a new join + push would work.
One transaction at a time: every update (from disk, NCCL receive / finish, sleep, wake-up, group join) runs
under the plane's update lock, so a second one waits for the first to end (a rollback never undoes another
caller's update); meanwhile /resume answers 409 ("a weight update is in progress"). Pause and resume never
take the lock, so a trainer's own /pause before an update cannot deadlock with it.
Requests in flight meanwhile are paused by SGLang (retract / in_place) and finish on one version: the old
one after a rollback, the new one after a success. A worker that restarts drops its own requests; the
proxy's data path ends those with an error, never silently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import NoReturn

from token_proxy.errors import BackendTimeout, BackendUnavailable, InvalidRequest
from token_proxy.fleet.flush import safe_flush, settle_owed_flushes, settle_refusals
from token_proxy.fleet.plane import AdminPlane, StepResult
from token_proxy.sglang.workers import WorkerFailed, WorkerReply, failure_status, raise_for_failures

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 30.0
RETRY_DOWN_S = 0.25  # how often a rollback knocks on a worker that is down
ROLLED_BACK, HELD = "rolled_back", "held_paused"
DESTROY_GONE = "The group to be destroyed does not exist"  # SGLang's answer for a group it does not hold


@dataclass(slots=True)
class WorkerResult:
    url: str
    ok: bool
    status: int | None
    message: str
    weight_version: str | None = None  # what the worker reported after the step
    checksum: str | None = None  # SGLang's per_engine_checksum, when asked for

    def as_dict(self) -> dict:
        out = {"url": self.url, "success": self.ok, "status": self.status, "message": self.message,
               "weight_version": self.weight_version}
        if self.checksum is not None:
            out["checksum"] = self.checksum
        return out


class FleetFailed(WorkerFailed):
    """A fleet update that did not land everywhere: OpenAI's error body plus the outcome and each worker's
    result (the one error middleware renders `body()`)."""

    def __init__(self, status: int, message: str, outcome: str, workers: list[WorkerResult],
                 weight_version: str | None = None):
        super().__init__(status, message)
        self.outcome = outcome  # ROLLED_BACK or HELD
        self.workers = workers
        self.weight_version = weight_version  # what the fleet serves now (None while held)

    def body(self) -> dict:
        return {**super().body(), "outcome": self.outcome, "weight_version": self.weight_version,
                "workers": [w.as_dict() for w in self.workers]}


async def update_from_disk(plane: AdminPlane, path: str, version: str | None, action: str,
                           verify_checksum: bool = False) -> list[WorkerResult]:
    """Every worker to the checkpoint at `path` as `version`, or FleetFailed (rolled back or held)."""
    async with plane.transaction():
        return await _update_from_disk(plane, path, version, action, verify_checksum)


async def _update_from_disk(plane: AdminPlane, path: str, version: str | None, action: str,
                            verify_checksum: bool) -> list[WorkerResult]:
    urls = await plane.worker_urls()
    paused_here = await _pause_unless_paused(plane, urls)
    before_version, before_path = plane.weights.version, plane.weights.loaded_path
    bodies = await safe_flush(plane, [{"model_path": path, "flush_cache": True, "weight_version": version}]
                              * len(urls), urls)
    replies = await settle_refusals(plane, await plane.fan_out(
        "POST", "/update_weights_from_disk", bodies, plane.settings.weight_update_timeout_s, urls), version)
    results = await _verify(plane, urls, replies, version, verify_checksum)
    if all(r.ok for r in results):
        plane.record_version(version)
        plane.weights.loaded_path = path
        set_hold(plane, None)
        plane.weights.checkpoint_proven = True  # this controller loaded it as the fleet's version (a heal may use it)
        plane.weights.checksum_verified = verify_checksum  # the fence verifies a healed worker the same way
        if paused_here:
            await resume_all(plane, urls, f"{action} landed on every worker (version {version}), but resume")
        return results
    await _fail(plane, urls, replies, results, action, before_version, before_path, paused_here, False)


async def recover(plane: AdminPlane, urls: list[str], replies: list[WorkerReply], action: str,
                  every_worker_changed: bool = False, expected: str | None = None, status: int | None = None,
                  note: str = "") -> NoReturn:
    """A step of an update failed on some worker: roll the fleet back to its checkpoint, or hold it."""
    results = await _verify(plane, urls, replies, expected, False)
    await _fail(plane, urls, replies, results, action, plane.weights.version, plane.weights.loaded_path, False,
                every_worker_changed, status, note)


async def push_failed(plane: AdminPlane, urls: list[str], replies: list[WorkerReply], action: str) -> NoReturn:
    """The one place every dialect's failed or abandoned NCCL push ends (prime-rl's /update_weights
    {"weight_dir": null} and the forwarded /update_weights_from_distributed, vLLM's /update_weights
    {"update_info"} and collective_rpc): the caller holds the plane's transaction.

    Every live weight-update group is destroyed on every worker, so the trainer's next init with the same
    name works (SGLang keeps a group whose receive failed, and refuses its name again). The workers hold
    partial weights (SGLang: "partially updated. Please discard the whole weights"), so the fleet is rolled
    back to its checkpoint on disk, else HELD (paused, /weight_info inconsistent, /resume 409) until a
    complete push or /resume?force=true. The status says what to do: 503 (retry: join again, push again)
    unless every worker refused the push itself (400). A prime-rl call waiting for this push gets it."""
    plane.push.open = False
    status = push_status(replies)
    note = await destroy_groups(plane, urls)
    try:
        await recover(plane, urls, replies, action, every_worker_changed=True, status=status, note=note)
    except FleetFailed as exc:
        plane.push.publish(StepResult(False, exc.message, None, exc.status))
        raise


def push_status(replies: list[WorkerReply]) -> int:
    """400 when every worker refused the push (the push itself is wrong: retrying it fails again); 504 when
    every failure is a timeout; else 503: some worker refused or failed mid-push or was cut off while others
    took it, and a new join + push would work (prime-rl retries 5xx)."""
    failed = [r for r in replies if not r.ok]
    refused = [r for r in failed if r.error is None]
    if len(refused) == len(replies) and all(400 <= r.status < 500 for r in refused):
        return 400
    if not refused and all(isinstance(r.error, BackendTimeout) for r in failed):
        return 504
    return 503


async def destroy_groups(plane: AdminPlane, urls: list[str]) -> str:
    """/destroy_weights_update_group for every live group on every worker; what to tell the trainer."""
    names = sorted(plane.push.live_groups) or ["weight_update_group"]
    plane.push.live_groups.clear()
    left = []
    for name in names:
        replies = await plane.fan_out("POST", "/destroy_weights_update_group", {"group_name": name},
                                      plane.settings.admin_timeout_s, urls)
        left += [f"{r.url}: {r.message}" for r in replies
                 if not r.ok and DESTROY_GONE not in r.message]  # never joined, or gone with a restart
    quoted = ", ".join(repr(name) for name in names)
    if left:
        log.error("destroying the weight-update group %s failed: %s", quoted, "; ".join(left))
        return (f"; destroying the weight-update group {quoted} failed on " + "; ".join(left)
                + " (POST /destroy_weights_update_group before joining again)")
    return (f"; the weight-update group {quoted} was destroyed on every worker: join again (the same name "
            "works) and push again")


async def _fail(plane: AdminPlane, urls: list[str], replies: list[WorkerReply], results: list[WorkerResult],
                action: str, before_version: str | None, before_path: str | None, paused_here: bool,
                every_worker_changed: bool, status: int | None = None, note: str = "") -> NoReturn:
    failed = [r for r in results if not r.ok]
    if not failed:  # every call succeeded, yet the workers disagree
        failed = results
        for r in results:
            r.ok, r.message = False, f"reports weight version {r.weight_version!r}; the workers disagree"
    refused = [reply for reply in replies if not reply.ok]
    status = status or (failure_status(refused) if refused else 502)
    message = f"{action} failed on {len(failed)} of {len(urls)} worker(s): " + "; ".join(
        f"{r.url}: {r.message}" for r in failed) + note
    # Left alone: a worker that refused (an answer, no change) and still reports the old version. One that
    # timed out or could not be reached may yet apply the update: it is rolled back too.
    stale = [r.url for r, reply in zip(results, replies)
             if every_worker_changed or reply.ok or reply.status == 0 or r.weight_version != before_version]
    await _roll_back_or_hold(plane, urls, results, stale, before_path, before_version, paused_here, status,
                             message)
    raise AssertionError("unreachable")


async def _roll_back_or_hold(plane: AdminPlane, urls: list[str], results: list[WorkerResult], stale: list[str],
                             path: str | None, version: str | None, paused_here: bool, status: int,
                             message: str) -> None:
    if path is not None or not stale:  # nothing changed anywhere: nothing to reload
        replies = []
        if stale:
            log.warning("%s; rolling %s back to %s (version %s)", message, ", ".join(stale), path, version)
            body = {"model_path": path, "flush_cache": True, "weight_version": version}
            replies = list(await asyncio.gather(*(_reload(plane, url, body) for url in stale)))
        after = await _verify(plane, urls, _merge(urls, stale, replies), version, False)
        if all(r.ok for r in after):
            plane.record_version(version)
            set_hold(plane, None)
            note = f"; every worker rolled back to version {version}" if stale else ""
            if paused_here:
                try:
                    await resume_all(plane, urls)
                except WorkerFailed as exc:
                    note += f"; {exc.message} (POST /resume again)"
            raise FleetFailed(status, message + note, ROLLED_BACK, _annotate(results, after), version)
        results = _annotate(results, after)
        message += "; the rollback failed too: " + "; ".join(f"{r.url}: {r.message}" for r in after if not r.ok)
    await _hold(plane, urls, message, stale)
    raise FleetFailed(status, message + "; every worker stays paused (POST /resume?force=true to serve anyway)",
                      HELD, results)


async def _reload(plane: AdminPlane, url: str, body: dict) -> WorkerReply:
    """One worker back to the old checkpoint. A worker that is down (restarting) is waited for, up to
    --weight-update-timeout, and paused first when it is back (a restarted SGLang comes back unpaused)."""
    deadline = time.monotonic() + plane.settings.weight_update_timeout_s
    (flushable,) = await safe_flush(plane, [body], [url])
    (reply,) = await plane.fan_out("POST", "/update_weights_from_disk", flushable,
                                   plane.settings.weight_update_timeout_s, [url])
    while _down(reply) and time.monotonic() < deadline:
        await asyncio.sleep(RETRY_DOWN_S)
        left = max(deadline - time.monotonic(), 0.1)
        if plane.control.paused:  # the rest of the fleet is paused: so must the restarted worker be
            (reply,) = await pause_workers(plane, plane.settings.pause_mode, [url], all_or_none=False,
                                           timeout_s=min(left, plane.settings.admin_timeout_s))
            if not reply.ok:
                continue
        (flushable,) = await safe_flush(plane, [body], [url])
        (reply,) = await plane.fan_out("POST", "/update_weights_from_disk", flushable, left, [url])
    (reply,) = await settle_refusals(plane, [reply], body.get("weight_version"))
    return reply


def _down(reply: WorkerReply) -> bool:
    """Not listening (connection refused / reset), or answering 503 while it starts."""
    return isinstance(reply.error, BackendUnavailable) or reply.status == 503


def _merge(urls: list[str], stale: list[str], replies: list[WorkerReply]) -> list[WorkerReply]:
    """Replies for every url: the rollback's where one ran, a stand-in success elsewhere."""
    by_url = dict(zip(stale, replies))
    return [by_url.get(url) or stand_in(url) for url in urls]


def stand_in(url: str) -> WorkerReply:
    """A success reply for a worker that was not asked (or whose own reply does not matter)."""
    return WorkerReply(url, 200, b"{}", "application/json")


def _annotate(results: list[WorkerResult], after: list[WorkerResult]) -> list[WorkerResult]:
    """The update's result per worker, with the version it reports after the rollback."""
    now = {r.url: r for r in after}
    return [WorkerResult(r.url, r.ok, r.status, r.message, now[r.url].weight_version, r.checksum) for r in results]


async def _verify(plane: AdminPlane, urls: list[str], replies: list[WorkerReply], version: str | None,
                  checksum: bool) -> list[WorkerResult]:
    """Each worker's result: its update reply, then the version it reports (and its weights checksum)."""
    versions = await read_versions(plane, urls)
    sums = await read_checksums(plane, urls) if checksum else {}
    results = []
    for url, reply in zip(urls, replies):
        reported = versions.get(url)
        ok, message = reply.ok, reply.message if not reply.ok else "ok"
        if ok and version is not None and reported != version:
            ok, message = False, f"reports weight version {reported!r} after the update, not {version!r}"
        results.append(WorkerResult(url, ok, reply.status or None, message, reported, sums.get(url)))
    if checksum and all(r.ok for r in results) and len({r.checksum for r in results}) != 1:
        for r in results:
            r.ok, r.message = False, f"weights checksum {r.checksum} differs across workers"
    return results


async def read_versions(plane: AdminPlane, urls: list[str]) -> dict[str, str | None]:
    """What each worker says it serves (/model_info weight_version); None when it cannot say."""
    replies = await plane.fan_out("GET", "/model_info", None, READ_TIMEOUT_S, urls)
    versions = {reply.url: reply.weight_version for reply in replies}
    plane.fenced.worker_versions.update(versions)
    return versions


async def read_checksums(plane: AdminPlane, urls: list[str]) -> dict[str, str | None]:
    """SGLang's /weights_checker per_engine_checksum of each worker (sha256 over its ranks' checksums)."""
    replies = await plane.fan_out("POST", "/weights_checker", {"action": "checksum"},
                                  plane.settings.admin_timeout_s, urls)
    missing = [r for r in replies if r.status == 404]
    if missing:
        raise WorkerFailed(501, f"{missing[0].url} has no /weights_checker (SGLang >= 0.5.17 has it): cannot "
                                "verify weights checksums")
    return {r.url: (r.body.get("per_engine_checksum") if r.ok and isinstance(r.body, dict) else None)
            for r in replies}


async def _pause_unless_paused(plane: AdminPlane, urls: list[str]) -> bool:
    if plane.control.paused:
        return False
    await pause_workers(plane, plane.settings.pause_mode, urls, "pause before the update")
    return True


async def pause_workers(plane: AdminPlane, mode: str, urls: list[str], action: str = "pause",
                        all_or_none: bool = True, timeout_s: float | None = None) -> list[WorkerReply]:
    """SGLang's /pause_generation on every worker of `urls`, recorded on the plane (/is_paused, /resume).
    All or none: a partial pause is undone (the workers that paused continue) and raised, unless the fleet
    was paused already. A hold (all_or_none=False) pauses what it can and returns each reply."""
    replies = await plane.fan_out("POST", "/pause_generation", {"mode": mode},
                                  timeout_s or plane.settings.admin_timeout_s, urls)
    failed = [r for r in replies if not r.ok]
    if failed and all_or_none:
        note = ""
        if not plane.control.paused:
            await plane.fan_out("POST", "/continue_generation", {}, plane.settings.admin_timeout_s,
                                [r.url for r in replies if r.ok])
            note = "; the workers that paused were resumed (nothing changed)"
        raise WorkerFailed(failure_status(failed), f"{action} failed on {len(failed)} of {len(replies)} worker(s): "
                           + "; ".join(f"{r.url}: {r.message}" for r in failed) + note)
    plane.mark_paused()
    return replies


async def resume_all(plane: AdminPlane, urls: list[str], action: str = "resume") -> None:
    """/continue_generation on every worker, then the flushes owed; a worker that stays paused is an error
    naming it (the fleet stays recorded as paused, so /resume can be sent again). A worker the fence keeps
    out stays paused: the fence lets it in once it holds the fleet's weights."""
    urls = [url for url in urls if url not in plane.fenced.urls]
    replies = await plane.fan_out("POST", "/continue_generation", {}, plane.settings.admin_timeout_s, urls)
    if all(r.ok for r in replies):
        plane.control.paused = False
    if plane.workers.spawn is not None:
        settle_owed_flushes(plane, plane.workers.spawn)
    raise_for_failures(action, replies)


async def _hold(plane: AdminPlane, urls: list[str], message: str, changed: list[str] | None = None) -> None:
    """`changed`: the workers whose weights the failed update may have changed (partial weights, as
    /weight_info names them while held)."""
    versions = await read_versions(plane, urls)
    await pause_workers(plane, plane.settings.pause_mode, urls, all_or_none=False)
    set_hold(plane, {"message": message, "worker_versions": versions, "changed": list(changed or urls)})
    log.error("fleet held paused: %s", message)


def set_hold(plane: AdminPlane, hold: dict | None) -> None:
    """The one place a hold starts or ends: the version record the data path reads (its prompt 503 while
    held, plane.unavailable) is made again at once, or a held fleet's chats would wait on paused workers and
    a released one's would still be refused."""
    plane.control.hold = hold
    plane.note_change()


def refuse_resume(plane: AdminPlane, force: bool) -> None:
    """/resume refused (409) while a weight update runs (its pause is its own), and while a failed update
    left the workers on different versions (unless forced)."""
    if plane.control.updating:
        raise Conflict("a weight update is in progress: it resumes the workers it paused when it ends")
    refuse_resume_while_held(plane, force)


def refuse_resume_while_held(plane: AdminPlane, force: bool) -> None:
    if plane.control.hold is None:
        return
    if force:
        log.warning("resume forced while held: %s", plane.control.hold["message"])
        set_hold(plane, None)
        return
    versions = ", ".join(f"{url}: {v!r}" for url, v in plane.control.hold["worker_versions"].items())
    raise Conflict(f"the workers are held paused after a failed weight update ({plane.control.hold['message']}); "
                   f"versions now: {versions}. Update them all to one version, or POST /resume?force=true "
                   "to serve anyway")


class Conflict(InvalidRequest):
    """The request is fine but the admin plane's state forbids it now (409)."""

    status = 409
    type = "ConflictError"


async def gather_versions(plane: AdminPlane) -> list[dict]:
    """Each worker's version as /weight_info and prime-rl's status show it."""
    urls = await plane.worker_urls()
    versions = await read_versions(plane, urls)
    return [{"url": url, "weight_version": versions.get(url)} for url in urls]

