"""The bridge's control process: an aiohttp API the proxy drives, and one receiver process per rank.

Routes (JSON; the proxy is the only caller):
- `GET /bridge/info` → the GPUs served, the NCCL version, whether a group is joined;
- `POST /bridge/join` {host, port, world_size, rank_offset, ranks, dialect, timeout_s} → joins the trainer's group
  with one receiver per rank (a previous group is dropped first); answers when every rank has joined, or the
  first rank's one-line reason;
- `POST /bridge/push` {dialect, update_info?, packed?, buffer_size_bytes?, timeout_s?} → receives one push and
  loads it into SGLang bucket by bucket, each bucket's names and shapes first checked against the checkpoint SGLang
  serves (params.py says why: SGLang 0.5.17 drops an unknown name and crashes on a wrong shape); answers {ok, buckets, tensors, bytes, seconds, errors: [{worker,
  message}]} once the stream has ended (after a refusal too: the rest is drained);
- `POST /bridge/leave` → stops the receivers.

The control process imports no torch: CUDA lives in the receivers (spawned, so each join gets a fresh NCCL with
the environment it is given).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from token_proxy.bridge import params, sglang_load
from token_proxy.bridge.layout import Gpu, LayoutError, Receiver, plan_receivers
from token_proxy.bridge.nccl import JoinSpec
from token_proxy.bridge.receiver import PushSpec, serve
from token_proxy.bridge.wire import WireError, metas_from_update_info

log = logging.getLogger(__name__)

DIALECTS = ("primerl", "vllm")


@dataclass(frozen=True, slots=True)
class BridgeSettings:
    workers: tuple[str, ...]
    nccl_env: tuple[tuple[str, str], ...] = ()
    load_timeout_s: float = 600.0


@dataclass(slots=True)
class Rank:
    plan: Receiver
    process: Any
    conn: Any


@dataclass(slots=True)
class Bridge:
    settings: BridgeSettings
    session: aiohttp.ClientSession
    gpus: list[Gpu] = field(default_factory=list)
    ranks: list[Rank] = field(default_factory=list)
    dialect: str = ""
    last_metas: tuple = ()
    shapes: dict[str, dict[str, tuple[int, ...]] | None] = field(default_factory=dict)  # worker → params.py's table
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    log_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="bridge-nccl-"))
    spawn: Callable[..., Rank] | None = None  # how a receiver starts: _spawn (a process); tests give threads


BRIDGE = web.AppKey("bridge", Bridge)


class BadRequest(web.HTTPBadRequest):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(text=_error(message, param), content_type="application/json")


def _error(message: str, param: str | None = None) -> str:
    import json

    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}})


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _int(body: dict, key: str, default: int | None = None) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{key} must be an integer", key)
    return value


def _seconds(body: dict, default: float) -> float:
    value = body.get("timeout_s", default)
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise BadRequest("timeout_s must be a positive number of seconds", "timeout_s")
    return float(value)


def _dialect(body: dict) -> str:
    dialect = body.get("dialect")
    if dialect not in DIALECTS:
        raise BadRequest(f"dialect must be one of {', '.join(DIALECTS)}", "dialect")
    return dialect


async def info(request: web.Request) -> web.Response:
    bridge = request.app[BRIDGE]
    return web.json_response({"gpus": [g.gpu for g in bridge.gpus], "workers": list(bridge.settings.workers),
                              "tp_ranks": len(bridge.gpus), "joined": [r.plan.rank for r in bridge.ranks],
                              "dialect": bridge.dialect})


async def join(request: web.Request) -> web.Response:
    bridge, body = request.app[BRIDGE], await _body(request)
    host = body.get("host")
    if not isinstance(host, str) or not host:
        raise BadRequest("host must be the trainer's address", "host")
    world, offset, count = _int(body, "world_size"), _int(body, "rank_offset"), _int(body, "ranks")
    port, dialect, timeout_s = _int(body, "port"), _dialect(body), _seconds(body, 300.0)
    try:
        plan = plan_receivers(bridge.gpus, world_size=world, rank_offset=offset, ranks=count)
    except LayoutError as exc:
        raise BadRequest(str(exc), "ranks") from None
    async with bridge.lock:  # a new init replaces the old group (the trainer restarted, or a push tore it)
        await _leave(bridge)
        bridge.dialect, bridge.last_metas = dialect, ()
        env = dict(bridge.settings.nccl_env)
        start = bridge.spawn or _spawn
        bridge.ranks = [start(r, JoinSpec(host, port, world, r.rank, r.gpu, timeout_s), env, bridge.log_dir,
                              bridge.dialect) for r in plan]
        replies = await asyncio.gather(*(_recv(r, timeout_s + 60) for r in bridge.ranks))
        failed = [m[1] for m in replies if m[0] != "joined"]
        if failed:
            log.error("join failed: %s", "; ".join(failed))
            await _leave(bridge)
            return web.json_response({"ok": False, "errors": failed}, status=502)
    log.info("joined the trainer's group at %s:%d (%s): %s", host, port, dialect, [m[1] for m in replies])
    return web.json_response({"ok": True, "ranks": [m[1] for m in replies]})


def _spawn(plan: Receiver, spec: JoinSpec, env: dict, log_dir: str, dialect: str) -> Rank:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=serve, args=(child, plan, spec, env, log_dir, dialect), daemon=True,
                          name=f"bridge-rank-{plan.rank}")
    process.start()
    child.close()
    return Rank(plan, process, parent)


async def _recv(rank: Rank, timeout_s: float) -> tuple:
    loop = asyncio.get_running_loop()
    ready = await loop.run_in_executor(None, rank.conn.poll, timeout_s)
    if not ready:
        return ("failed", f"rank {rank.plan.rank} (GPU {rank.plan.gpu}) did not answer within {timeout_s:g} s")
    try:
        return rank.conn.recv()
    except (EOFError, OSError):
        return ("failed", f"rank {rank.plan.rank} (GPU {rank.plan.gpu}) died (exit code {rank.process.exitcode})")


async def leave(request: web.Request) -> web.Response:
    bridge = request.app[BRIDGE]
    async with bridge.lock:
        await _leave(bridge)
    return web.json_response({"ok": True})


async def _leave(bridge: Bridge) -> None:
    for rank in bridge.ranks:
        try:
            rank.conn.send(("stop",))
        except (OSError, ValueError):
            pass
    for rank in bridge.ranks:  # a receiver stuck in NCCL (a trainer that went away) is killed after 5 s
        await asyncio.get_running_loop().run_in_executor(None, rank.process.join, 5)
        if rank.process.is_alive():
            rank.process.kill()
        rank.conn.close()
    bridge.ranks = []


async def push(request: web.Request) -> web.Response:
    bridge, body = request.app[BRIDGE], await _body(request)
    dialect = _dialect(body)
    spec = _push_spec(bridge, dialect, body)
    async with bridge.lock:
        if not bridge.ranks:
            raise BadRequest("no trainer group is joined: the trainer's init (/init_broadcaster or "
                             "/init_weight_transfer_engine) must come first")
        if dialect != bridge.dialect:
            raise BadRequest(f"the group was joined for {bridge.dialect}, not {dialect}", "dialect")
        started = time.perf_counter()
        result = await _run_push(bridge, spec, _seconds(body, bridge.settings.load_timeout_s))
    result["seconds"] = round(time.perf_counter() - started, 4)
    log.info("push (%s): %d bucket(s), %d tensor(s), %.3f GiB in %.3f s, of which %.3f s waiting for SGLang's "
             "loads; errors: %s", dialect, result["buckets"], result["tensors"], result["bytes"] / (1 << 30),
             result["seconds"], result["load_s"], result["errors"] or "none")
    return web.json_response(result, status=200 if result["ok"] else 502)


def _push_spec(bridge: Bridge, dialect: str, body: dict) -> PushSpec:
    if dialect == "primerl":
        return PushSpec("primerl")
    try:
        metas = tuple(metas_from_update_info(body.get("update_info") or {}))
    except WireError as exc:
        raise BadRequest(str(exc), "update_info") from None
    if metas:
        bridge.last_metas = metas
    elif not bridge.last_metas:
        raise BadRequest("update_info is empty and no earlier push gave the names", "update_info")
    return PushSpec("vllm", bridge.last_metas, bool(body.get("packed", True)),
                    _int(body, "buffer_size_bytes", 1 << 30))


async def _run_push(bridge: Bridge, spec: PushSpec, timeout_s: float) -> dict:
    for rank in bridge.ranks:
        rank.conn.send(("push", spec))
    totals = {"buckets": 0, "tensors": 0, "bytes": 0}
    errors: list[dict] = []
    live = list(bridge.ranks)
    refused = torn = False
    load_s = 0.0
    while live:
        messages = await asyncio.gather(*(_recv(r, timeout_s) for r in live))
        finished = [(r, m) for r, m in zip(live, messages) if m[0] != "bucket"]
        for rank, message in finished:
            live.remove(rank)
            if message[0] == "failed":  # a torn stream, a dead or silent rank: not a refusal
                torn = True
                errors.append({"worker": ",".join(g.worker for g in rank.plan.serves), "message": message[1],
                               "torn": True})
        buckets = [(r, m) for r, m in zip(live, messages) if m[0] == "bucket"]
        if not buckets:
            continue
        t0 = time.perf_counter()
        ok, refusals = await _load(bridge, buckets, timeout_s, skip=refused or bool(errors))
        load_s += time.perf_counter() - t0
        refused = refused or not ok
        errors += refusals
        totals["buckets"] = max(totals["buckets"], buckets[0][1][1] + 1)
        totals["tensors"] += buckets[0][1][4]
        totals["bytes"] += buckets[0][1][3]
        for rank, message in buckets:
            rank.conn.send(("ack", message[1], ok, refusals[0]["message"] if refusals else ""))
    if torn:  # ranks stuck in (or out of) the stream cannot take the next push: the trainer must init again
        await _leave(bridge)
    return {"ok": not errors, **totals, "load_s": round(load_s, 4), "errors": errors}


async def _load(bridge: Bridge, buckets: Sequence[tuple[Rank, tuple]], timeout_s: float, skip: bool,
                ) -> tuple[bool, list[dict]]:
    """One bucket index from every rank: merged per worker (payloads in TP order), loaded into each worker."""
    if skip:
        return False, []
    per_worker: dict[str, dict[int, str]] = {}
    checks: dict[str, str] = {}
    for rank, message in buckets:
        for gpu in rank.plan.serves:
            per_worker.setdefault(gpu.worker, {})[gpu.tp_rank] = message[2][gpu.tp_rank]
            checks[gpu.worker] = checks.get(gpu.worker) or params.refusal(bridge.shapes.get(gpu.worker), message[5])
    refusals = [{"worker": url, "message": f"{url}: {why}"} for url, why in checks.items() if why]
    if refusals:  # SGLang is given nothing of this bucket (on any worker): it would drop or crash on it
        return False, refusals
    results = await asyncio.gather(*(
        sglang_load.load_bucket(bridge.session, url, [tps[i] for i in sorted(tps)], timeout_s)
        for url, tps in per_worker.items()))
    refusals = [{"worker": url, "message": text} for url, (ok, text) in zip(per_worker, results) if not ok]
    return not refusals, refusals


def create_bridge_app(settings: BridgeSettings, spawn: Callable[..., Rank] | None = None) -> web.Application:
    app = web.Application()
    app.add_routes([web.get("/bridge/info", info), web.post("/bridge/join", join),
                    web.post("/bridge/push", push), web.post("/bridge/leave", leave)])

    async def context(app: web.Application):
        async with aiohttp.ClientSession() as session:
            bridge = Bridge(settings, session, spawn=spawn)
            for url in settings.workers:
                bridge.gpus += await sglang_load.worker_gpus(session, url)
                bridge.shapes[url] = params.checkpoint_shapes(await sglang_load.model_path(session, url))
                if bridge.shapes[url] is None:
                    log.warning("%s: its model is not a local safetensors checkpoint: received names and shapes are "
                                "not checked before SGLang loads them", url)
            app[BRIDGE] = bridge
            yield
            await _leave(bridge)

    app.cleanup_ctx.append(context)
    return app
