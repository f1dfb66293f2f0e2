"""Weight-update group joins (/init_weights_update_group), watched: a join that cannot complete never hangs the
fleet's chats silently.

What SGLang 0.5.17 does (simulator/scheduler_block.py mimics it): the join runs on the scheduler's thread and
torch's rendezvous gets no timeout from SGLang (torch's default: 30 minutes). Until the trainer meets it, the
worker serves nothing: its chats wait, its /health answers 503 after 20 s. A trainer that never comes (a port
race: EADDRINUSE on the master) wedges the worker for those 30 minutes, then SGLang answers 400.

The proxy's rules (every join passes through AdminPlane.fan_out, whichever route asked for it):
- each worker's join is a call of its own, left open until SGLang answers it (at most torch's timeout plus a
  margin); the caller waits up to its own bound (--init-group-timeout, or prime-rl's `timeout`) and a worker
  that has not answered by then is answered 504 for it;
- while a worker is joining it is named in /weight_info `joining`; once its join has lasted JOIN_GRACE_S and
  every worker the data path reaches is joining (or fenced), chats get a prompt 503 with Retry-After
  (plane.unavailable; the proxy's /health says why too) instead of a wait on a blocked scheduler. A healthy
  join (the trainer meets the workers within a moment) never refuses a chat: the chats it delays are served
  when it ends; those sent during the grace of a join that never completes wait until SGLang answers it;
- when SGLang finally answers a join its caller gave up on, the worker serves again: a group it joined late is
  destroyed at once (its caller was told the join failed and joins again under the same name, which SGLang
  refuses while the name is registered); a failed join leaves nothing. Either way its mark is cleared. A worker
  that restarts meanwhile closes the call: cleared too (the fence heals it as any restarted worker).
Behind sglang-router with only some workers wedged, chats the router sends to a wedged one still wait: the proxy
cannot choose the worker of a chat there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from token_proxy.errors import BackendTimeout
from token_proxy.settings import Settings
from token_proxy.sglang.workers import WorkerReply, Workers

log = logging.getLogger(__name__)

JOIN_PATH = "/init_weights_update_group"
# torch's default_pg_timeout, which SGLang's init_custom_process_group leaves in force, and a margin: a worker
# that has not answered its join by then is gone.
TORCH_RENDEZVOUS_S = 1800.0
LATE_MARGIN_S = 60.0
DEFAULT_GROUP = "weight_update_group"
# How long a join may last before the chats that would wait on it are refused: a trainer and its workers meet
# within a moment (prime-rl's orchestrator and trainer join together), so a join older than this is stuck.
JOIN_GRACE_S = 2.0


@dataclass(slots=True)
class Join:
    url: str
    group: str
    since: float = field(default_factory=time.monotonic)
    caller_gave_up: bool = False  # its caller was answered 504; SGLang answers later

    def as_dict(self) -> dict:
        return {"url": self.url, "group_name": self.group, "joining_for_s": round(time.monotonic() - self.since, 3),
                "caller_gave_up": self.caller_gave_up}


@dataclass
class Joins:
    """The joins SGLang has not answered yet (url -> its join) and the calls that wait for their answers."""

    open: dict[str, Join] = field(default_factory=dict)
    calls: set[asyncio.Task] = field(default_factory=set)

    def info(self) -> list[dict]:
        return [join.as_dict() for join in self.open.values()]

    def blocking(self, urls: set[str]) -> str | None:
        """Why the workers `urls` (every one the data path reaches) serve nothing now (each inside a join for
        JOIN_GRACE_S or longer), or None."""
        stuck_since = time.monotonic() - JOIN_GRACE_S
        if not urls or not urls <= {url for url, join in self.open.items() if join.since <= stuck_since}:
            return None
        named = ", ".join(f"{url} (group {self.open[url].group!r})" for url in sorted(urls))
        return (f"every worker is inside {JOIN_PATH}: {named}; SGLang's scheduler serves nothing until the group's "
                "rendezvous completes or torch gives up (30 min). GET /weight_info `joining` names them")

    async def close(self) -> None:
        for call in list(self.calls):
            call.cancel()
        await asyncio.gather(*self.calls, return_exceptions=True)


class Plane(Protocol):
    """What a join needs of the admin plane (plane.py's AdminPlane, which calls `join`)."""

    settings: Settings
    workers: Workers
    joins: Joins

    def note_change(self) -> None: ...


async def join(plane: Plane, method: str, bodies: list[dict] | dict | bytes | None, timeout_s: float,
               urls: list[str] | None) -> list[WorkerReply]:
    """The join on every worker, answered within `timeout_s`; a worker's call that outlasts it stays open."""
    urls = urls if urls is not None else await plane.workers.worker_urls()
    if not urls:
        return []
    bodies = bodies if isinstance(bodies, list) else [bodies] * len(urls)
    calls: dict[asyncio.Task, Join] = {}
    for url, body in zip(urls, bodies):
        entry = plane.joins.open[url] = Join(url, _group(body))
        call = asyncio.ensure_future(_one(plane, method, url, body, entry))
        plane.joins.calls.add(call)
        call.add_done_callback(plane.joins.calls.discard)
        calls[call] = entry
    plane.note_change()
    # the record the data path reads is remade on a change: one when the grace ends (a no-op once answered)
    asyncio.get_running_loop().call_later(JOIN_GRACE_S, plane.note_change)
    try:
        done, pending = await asyncio.wait(calls, timeout=timeout_s)
    except asyncio.CancelledError:  # the caller left: SGLang still answers every join
        for entry in calls.values():
            entry.caller_gave_up = True
        raise
    replies = {calls[call].url: call.result() for call in done}
    for call in pending:
        entry = calls[call]
        entry.caller_gave_up = True
        replies[entry.url] = WorkerReply(entry.url, 0, error=BackendTimeout(
            f"no answer to {JOIN_PATH} (group {entry.group!r}) within {timeout_s:g} s: the worker waits in torch's "
            "rendezvous for a peer that has not come (is the trainer's master_port free and reachable?) and serves "
            "nothing until torch gives up (30 min); the proxy destroys the group if the join completes later"))
    if pending:
        log.error("%s", replies[calls[next(iter(pending))].url].message)
        plane.note_change()
    return [replies[url] for url in urls]


async def _one(plane: Plane, method: str, url: str, body, entry: Join) -> WorkerReply:
    try:
        [reply] = await plane.workers.fan_out(method, JOIN_PATH, body, TORCH_RENDEZVOUS_S + LATE_MARGIN_S, [url])
        if entry.caller_gave_up:
            try:
                await _late(plane, entry, reply)
            except Exception:  # a background clean-up: say so, never raise into nobody
                log.exception("cleaning up after %s's late join of group %r failed", url, entry.group)
        return reply
    finally:
        if plane.joins.open.get(url) is entry:
            del plane.joins.open[url]
            plane.note_change()


async def _late(plane: Plane, entry: Join, reply: WorkerReply) -> None:
    took = time.monotonic() - entry.since
    if not reply.ok:
        log.warning("%s answered its %s (group %r) after %.0f s: %s; it serves again", entry.url, JOIN_PATH,
                    entry.group, took, reply.message)
        return
    [gone] = await plane.workers.fan_out("POST", "/destroy_weights_update_group", {"group_name": entry.group},
                                         plane.settings.admin_timeout_s, [entry.url])
    log.warning("%s joined group %r after %.0f s, when its caller had given up: group destroyed (%s); it serves "
                "again", entry.url, entry.group, took, gone.message if not gone.ok else "ok")


def _group(body) -> str:
    if isinstance(body, dict) and body.get("group_name"):
        return str(body["group_name"])
    return DEFAULT_GROUP
