"""Bridge mode (`--weight-bridge URL[,URL]`): the trainer's own NCCL sender pushes, unmodified, through the weight
bridges (`python -m token_proxy.bridge`, one per inference node) instead of joining SGLang's group.

The proxy answers the trainer's routes as before (prime_rl.py, vllm_weights.py hand over here) and drives the
bridges over HTTP: an init becomes `/bridge/join` on every bridge, with the trainer's group split into contiguous
rank slices in bridge order; a push becomes `/bridge/push` on every bridge inside one SGLang weight-update session
(weight_session.bracketed). The fleet's rules stay the fleet's: a push that failed anywhere ends in
`fleet.push_failed` (rolled back or held), the version and the flush are `vllm_weights.finish`'s. A bridge that
drained a refused push keeps its group, so the next push recovers without a new init.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import web

from token_proxy.errors import BackendUnavailable, InvalidRequest
from token_proxy.fleet import transaction as fleet
from token_proxy.fleet import weight_session
from token_proxy.fleet.plane import AdminPlane
from token_proxy.sglang.workers import WorkerFailed, WorkerReply

GROUP = "weight_bridge"  # the name the plane's live_groups holds while the bridges are joined


@dataclass
class BridgeMode:
    urls: tuple[str, ...]
    session: aiohttp.ClientSession | None = None
    served: dict[str, list[str]] = field(default_factory=dict)  # bridge → the SGLang workers it serves
    dialect: str = ""
    packed: bool = True
    buffer_size_bytes: int = 1 << 30
    # prime-rl retries /update_weights on a 5xx, but its trainer sends each step once: a retry must not start a
    # receive that would wait for the next step's stream. The failed step (its weight_dir) and its error.
    failed_step: tuple[str, Exception] | None = None


BRIDGES = web.AppKey("weight_bridges", BridgeMode)


def add_bridge_mode(app: web.Application, urls: Sequence[str]) -> None:
    if not urls:
        return
    mode = app[BRIDGES] = BridgeMode(tuple(urls))

    async def session(app: web.Application):
        async with aiohttp.ClientSession() as client:
            mode.session = client
            yield

    app.cleanup_ctx.append(session)


def enabled(app: web.Application) -> bool:
    return BRIDGES in app


def dialect(app: web.Application) -> str:
    """The dialect the bridges last joined for ("" before any init, or after the trainer's shutdown)."""
    return app[BRIDGES].dialect


def split_group(world_size: int, first_rank: int, bridges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each bridge's (rank_offset, ranks) from its (GPUs, workers), in bridge order: every bridge one rank per
    GPU, or every bridge one per worker; the trainer's group must be exactly that large (the bridge checks its
    own slice again against its GPUs)."""
    inference = world_size - first_rank
    for pick in (0, 1):
        sizes = [b[pick] for b in bridges]
        if sum(sizes) == inference:
            slices, rank = [], first_rank
            for n in sizes:
                slices.append((rank, n))
                rank += n
            return slices
    gpus, workers = sum(b[0] for b in bridges), sum(b[1] for b in bridges)
    raise InvalidRequest(f"the trainer's group has {inference} inference rank(s) (world {world_size}, first rank "
                         f"{first_rank}), but the weight bridges serve {gpus} SGLang GPU(s) on {workers} "
                         f"worker(s): size it to {gpus} (one rank per GPU) or {workers} (one per worker)",
                         param="world_size")


async def _call(mode: BridgeMode, url: str, method: str, path: str, body: dict | None, timeout_s: float,
                ) -> tuple[int, dict]:
    try:
        async with mode.session.request(method, f"{url}{path}", json=body,
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return r.status, orjson.loads(await r.read() or b"{}")
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        return 0, {"error": {"message": f"weight bridge {url}: {type(exc).__name__}: {exc}"}}


async def join(plane: AdminPlane, app: web.Application, dialect: str, trainer: dict, world_size: int,
               first_rank: int, timeout_s: float) -> None:
    """Every bridge joins its slice of the trainer's group; answers once all have (or names who could not)."""
    mode = app[BRIDGES]
    infos = await asyncio.gather(*(_call(mode, u, "GET", "/bridge/info", None, plane.settings.admin_timeout_s)
                                   for u in mode.urls))
    down = [f"{u}: {_message(body)}" for u, (status, body) in zip(mode.urls, infos) if status != 200]
    if down:
        raise WorkerFailed(502, "weight bridge unreachable: " + "; ".join(down))
    workers = set(await plane.worker_urls())
    mode.served = {u: list(body["workers"]) for u, (_, body) in zip(mode.urls, infos)}
    strays = [w for served in mode.served.values() for w in served if w not in workers]
    if strays:
        raise WorkerFailed(502, f"the weight bridges serve {', '.join(strays)}, which the proxy does not fan out to "
                                "(give both the same SGLang URLs: --worker and the bridge's --sglang)")
    slices = split_group(world_size, first_rank, [(b["tp_ranks"], len(b["workers"])) for _, b in infos])
    replies = await asyncio.gather(*(
        _call(mode, u, "POST", "/bridge/join", {**trainer, "world_size": world_size, "rank_offset": offset,
                                                "ranks": count, "dialect": dialect, "timeout_s": timeout_s},
              timeout_s + 120)
        for u, (offset, count) in zip(mode.urls, slices)))
    failed = [f"{u}: {_message(body)}" for u, (status, body) in zip(mode.urls, replies) if status != 200]
    if failed:
        await leave(plane, app)
        raise WorkerFailed(502, "the weight bridges could not join the trainer's group: " + "; ".join(failed))
    mode.dialect = dialect
    plane.push.live_groups.add(GROUP)


async def leave(plane: AdminPlane, app: web.Application) -> None:
    mode = app[BRIDGES]
    await asyncio.gather(*(_call(mode, u, "POST", "/bridge/leave", {}, plane.settings.admin_timeout_s)
                           for u in mode.urls))
    plane.push.live_groups.discard(GROUP)
    mode.dialect = ""


async def push(plane: AdminPlane, app: web.Application, action: str, update_info: dict | None = None) -> None:
    """One push through every bridge, inside one weight-update session; the caller holds the transaction."""
    mode = app[BRIDGES]
    if GROUP not in plane.push.live_groups:
        raise fleet.Conflict(f"{action}: the weight bridges have not joined the trainer's group: the trainer's "
                             "init (prime-rl: POST /init_broadcaster; vLLM: POST /init_weight_transfer_engine) "
                             "must come first")
    urls = await plane.worker_urls()
    body = {"dialect": mode.dialect, "packed": mode.packed, "buffer_size_bytes": mode.buffer_size_bytes,
            "timeout_s": plane.settings.weight_update_timeout_s}
    if update_info is not None:
        body["update_info"] = update_info

    async def call() -> list[WorkerReply]:
        results = await asyncio.gather(*(_call(mode, u, "POST", "/bridge/push", body,
                                               plane.settings.weight_update_timeout_s + 60) for u in mode.urls))
        return worker_replies(urls, mode, results)

    replies = await weight_session.bracketed(plane, urls, call, action)
    if not all(r.ok for r in replies):
        try:
            await fleet.push_failed(plane, urls, replies, action)
        finally:  # after a refusal the bridges drained the stream and stay joined: the next push needs no init
            if await _still_joined(plane, mode):
                plane.push.live_groups.add(GROUP)
    plane.weights.loaded_path = None
    if plane.control.hold is not None:
        plane.control.hold["received"] = True


async def _still_joined(plane: AdminPlane, mode: BridgeMode) -> bool:
    infos = await asyncio.gather(*(_call(mode, u, "GET", "/bridge/info", None, plane.settings.admin_timeout_s)
                                   for u in mode.urls))
    return all(status == 200 and body.get("joined") for status, body in infos)


def worker_replies(urls: Sequence[str], mode: BridgeMode, results: Sequence[tuple[int, dict]]) -> list[WorkerReply]:
    """Each SGLang worker's outcome, in SGLang's reply shape, from the bridges' answers: a refusal keeps
    SGLang's message; a worker whose bridge stopped for another worker's refusal, or failed, says so."""
    outcome: dict[str, WorkerReply] = {}
    for bridge, (status, body) in zip(mode.urls, results):
        errors = body.get("errors") or []
        named = {e.get("worker"): e.get("message", "") for e in errors}
        torn = {e.get("worker") for e in errors if e.get("torn")}  # a rank died or went silent: not SGLang's refusal
        for worker in mode.served.get(bridge, []):
            if status == 200:
                outcome[worker] = _reply(worker, 200, True, "pushed through the weight bridge")
            elif status == 0:
                outcome[worker] = WorkerReply(worker, 0, error=BackendUnavailable(_message(body)))
            elif worker in named:
                outcome[worker] = _reply(worker, 502 if worker in torn else 400, False, named[worker])
            else:
                why = "; ".join(named.values()) or _message(body)
                outcome[worker] = _reply(worker, 502, False, f"the push stopped on weight bridge {bridge}: {why}")
    return [outcome.get(url) or _reply(url, 502, False, "no weight bridge serves this worker") for url in urls]


def _reply(url: str, status: int, ok: bool, message: str) -> WorkerReply:
    return WorkerReply(url, status, orjson.dumps({"success": ok, "message": message}), "application/json")


def _message(body: dict) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message"))
    return "; ".join(str(e) for e in body.get("errors") or []) or str(body)[:300]
