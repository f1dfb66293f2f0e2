"""One owner for the fleet's weights (issue 37): the CONTROLLER and its FOLLOWERS.

Exactly one process controls a fleet's weights: it runs the transactions, the fence and the heals. That
is every proxy started without --fleet-controller (with --workers N, its admin owner process). A proxy
started with `--fleet-controller URL` follows that controller:
- every fleet admin call (weights, pause / resume, sleep / wake-up, weight-update groups, versions:
  `follows` says which) is forwarded to the controller as it came, and its answer returned as it is;
- it never fences or heals (no watcher runs);
- it learns the fleet's version record from the controller (GET /fleet/versions, a long poll) for its
  own stale-reply checks and its prompt 503 when no worker is healthy.
The controller is named, not discovered: the workers offer no place to agree on one (SGLang keeps no
writable shared state, and a proxy may sit in front of a subset of a router's workers), and a flag is
what the trainer's launcher already writes for every other address. Two would-be controllers are found
by the fence (strike, then stand_down): a version this process never set nor saw, appearing on a
worker with no restart between, is healed once like any change behind its back; a second within
FIGHT_WINDOW_S means another process updates the weights: the one that finds it stops acting and logs one
line naming this flag. At most one undo each, never an endless fight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
from aiohttp import web

from token_proxy.errors import BackendUnavailable
from token_proxy.fleet import version_feed
from token_proxy.fleet.plane import ADMIN
from token_proxy.route_row import ADMIN as ADMIN_KIND

log = logging.getLogger(__name__)

POLL_WAIT_S = 10.0  # the controller answers a follower's long poll at the next change, or after this
RETRY_S = 1.0
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def follows(route) -> bool:
    """A follower forwards this row to its controller: every admin-key route but LoRA's (each proxy
    keeps its own adapter registry, and loading an adapter twice is harmless)."""
    return route.kind == ADMIN_KIND and "lora" not in route.path


# ---- two would-be controllers

FIGHT_WINDOW_S = 30.0  # two foreign versions this close: another controller


def strike(fence, url: str, version: str) -> bool:
    """A version this process never set appeared on a worker (no restart between). Once is a change behind
    its back (fenced and healed like any drift); twice within FIGHT_WINDOW_S (the same worker again after a
    heal, or another worker) is another controller at work: True, stand down."""
    if fence.foreign.get(url) == version:
        return False  # the same sighting, read again
    fence.foreign[url] = version
    now = time.monotonic()
    fence.strikes = [t for t in fence.strikes if now - t < FIGHT_WINDOW_S] + [now]
    return len(fence.strikes) >= 2


async def stand_down(fence, url: str, version: str) -> None:
    """The fence (fence.py) saw versions this process never set nor saw appear twice (its strike): another
    process updates these workers' weights. Two controllers would undo each other forever,
    so this one stops acting: one line, the workers it kept out let back in (the other owns them now), its
    weight updates refused (409: plane.py's StoodDown) and its data path judging no reply by its own record."""
    plane = fence.plane
    plane.stood_down = (
        f"another process updates these workers' weights ({url} reports weight version {version!r}, which "
        "this proxy never set): this proxy no longer fences, heals or updates weights. Run ONE fleet "
        "controller and start every other proxy in front of the same workers with --fleet-controller "
        "<the controller's URL>, then restart this one")
    log.error("%s", plane.stood_down)
    for entry in list(fence.fenced.values()):
        with contextlib.suppress(Exception):  # best effort: the other controller owns these workers now
            if not plane.control.paused:
                await plane.fan_out("POST", "/continue_generation", {}, plane.settings.admin_timeout_s,
                                    [entry.url])
            if entry.removed:
                await fence.put_back(entry)
    fence.fenced.clear()
    plane.fenced.urls.clear()
    plane.note_change()


# ---- the follower's side

class ControllerMirror:
    """A follower's copy of its controller's record, written onto its own plane's VersionBoard (so the
    reply check, a --workers process's mirror and /weight_info read it as a controller's would be read)."""

    def __init__(self, app: web.Application, controller: str):
        self.app, self.controller = app, controller.rstrip("/")
        self.first = asyncio.Event()
        self.failing = False

    def headers(self) -> dict:
        key = self.app[ADMIN].settings.admin_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def run(self, session: aiohttp.ClientSession) -> None:
        seen = -1
        while True:
            try:
                seen = await self.poll(session, seen)
                self.failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (the controller restarts: keep the last record, ask again)
                if not self.failing:
                    log.warning("cannot read the fleet's versions from the controller %s: %s (the last record "
                                "known stays in force)", self.controller, exc)
                self.failing = True
                await asyncio.sleep(RETRY_S)

    async def poll(self, session: aiohttp.ClientSession, seen: int) -> int:
        url = f"{self.controller}/fleet/versions"
        timeout = aiohttp.ClientTimeout(total=POLL_WAIT_S + 10)
        async with session.get(url, params=version_feed.query(seen, POLL_WAIT_S if seen >= 0 else 0),
                               headers=self.headers(), timeout=timeout) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            seq, record = version_feed.read(await response.json(), same_clock=False)
        plane = self.app[ADMIN]
        plane.board.record = record
        plane.weights.version = record.current
        plane.news.bump()
        self.first.set()
        return seq


FOLLOWER_SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("follower_session", aiohttp.ClientSession)


async def forward_to_controller(request: web.Request) -> web.StreamResponse:
    """A fleet admin call on a follower: sent to the controller as it came; its answer returned as it is."""
    controller = request.app[ADMIN].settings.fleet_controller.rstrip("/")
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    body = await request.read()
    session = request.app[FOLLOWER_SESSION]
    timeout = aiohttp.ClientTimeout(total=request.app[ADMIN].settings.weight_update_timeout_s + 60)
    try:
        async with session.request(request.method, controller + request.path_qs, data=body or None,
                                   headers=headers, timeout=timeout) as upstream:
            raw = await upstream.read()
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
            return web.Response(body=raw, status=upstream.status, headers=out)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise BackendUnavailable(f"the fleet controller {controller} cannot be reached ({exc!r}): this proxy "
                                 "follows it (--fleet-controller) and never changes the weights itself") from exc


def add_follower(app: web.Application) -> None:
    """A follower: the controller's record mirrored onto the plane (after the plane's state exists)."""
    app.cleanup_ctx.append(_follower)


async def _follower(app: web.Application):
    plane = app[ADMIN]
    session = app[FOLLOWER_SESSION] = aiohttp.ClientSession()
    mirror = ControllerMirror(app, plane.settings.fleet_controller)
    task = asyncio.get_running_loop().create_task(mirror.run(session))
    with contextlib.suppress(asyncio.TimeoutError):  # start anyway: the first record arrives when it can
        await asyncio.wait_for(mirror.first.wait(), 5.0)
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await session.close()
