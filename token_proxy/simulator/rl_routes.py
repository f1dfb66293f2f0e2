"""SGLang 0.5.17's /weights_checker, its one-update-at-a-time lock, and failure injection for tests.

- POST|GET /weights_checker {"action": "checksum" | "snapshot" | "compare" | "reset_tensors"}: SGLang's
  reply, {"success", "message", "ranks": [{checksums, per_gpu_checksum, parallelism_info}],
  "per_engine_checksum"} (sha256 over the ranks' per_gpu_checksum; one rank here).
- Weight updates (from disk, distributed, version) run one at a time, as SGLang's model_update_lock does:
  a second update waits for the first, so a rollback sent after a timed-out update lands after it.
- POST /sim/faults {"faults": [{"kind": "fail" | "delay" | "restart", "message", "delay_s", "restart_s"}]}
  queues faults; each weight update takes the next one (GET /sim/faults lists what is left):
  pass = none (for the next update's turn); fail = SGLang's refusal (400, nothing changed); partial = a
  distributed receive that breaks midway: the first half of its tensors is loaded, the rest stays old, the group
  stays registered (a join with its name is refused until it is destroyed), and SGLang's 400 says the weights
  are "partially updated" (`message` names the cause); delay = the update starts `delay_s` late (a caller
  with a shorter timeout gives up, the update still lands); restart = the process dies mid-update (every
  in-flight request and this call's connection are cut) and comes back `restart_s` later with the
  weights and version it started with, unpaused.
  A fault with a "path" (e.g. "/continue_generation") is taken by the next call to that route instead.
- POST /sim/restart {"restart_s"}: the same restart at once, outside any update (a worker killed with -9
  and started again): it answers 503 for `restart_s`, then serves again on the weights and version it
  started with ("default" unless --weight-version), unpaused, as real SGLang does after a restart.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field

from aiohttp import web

from token_proxy.simulator import params
from token_proxy.simulator.admin_routes import _body
from token_proxy.simulator.errors import json_response
from token_proxy.simulator.prefix_cache import PrefixCache
from token_proxy.simulator.state import SIM_STATE, SimState
from token_proxy.simulator.weight_routes import PARTIAL, WEIGHTS, Weights

UPDATE_PATHS = frozenset({"/update_weights_from_disk", "/update_weights_from_distributed", "/update_weight_version"})
# 0.5.21+: the session's begin / end queue behind a running update too (SGLang's scheduler takes them in
# order); a fault reaches them only when it names their path.
SESSION_PATHS = frozenset({"/begin_weight_update", "/end_weight_update"})
FAULT_KINDS = ("pass", "fail", "partial", "delay", "restart")


@dataclass
class RlSim:
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    faults: list[dict] = field(default_factory=list)
    snapshot: dict[str, str] | None = None
    restarts: int = 0
    tasks: set = field(default_factory=set)


RL_SIM: web.AppKey[RlSim] = web.AppKey("sim_rl", RlSim)


def _hash(value) -> str:
    raw = value.float().numpy().tobytes() if hasattr(value, "float") else repr(value).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def checksums(sim: SimState, weights: Weights) -> dict[str, str]:
    sums = {name: _hash(value) for name, value in sorted(weights.values.items())}
    sums["checkpoint"] = hashlib.sha256(sim.weights_path.encode()).hexdigest()[:16]  # what disk loads change
    return sums


async def weights_checker(request: web.Request) -> web.Response:
    body = await _body(request, (1486, "check_weights"), allow_empty=True)
    action = body.get("action", "checksum")
    sim, weights, rl = request.app[SIM_STATE], request.app[WEIGHTS], request.app[RL_SIM]
    if action == "snapshot":
        rl.snapshot = checksums(sim, weights)
    elif action == "reset_tensors":
        weights.values = {name: params.initial_values(shape, salt=99) for name, shape in params.PARAM_SHAPES.items()}
    elif action == "compare":
        if rl.snapshot is None:
            return json_response({"success": False, "message": "No snapshot to compare against"}, 400)
        differ = sorted(k for k, v in checksums(sim, weights).items() if rl.snapshot.get(k) != v)
        if differ:
            return json_response({"success": False, "message": f"Tensors differ: {differ}"}, 400)
    elif action == "checksum":
        sums = checksums(sim, weights)
        per_gpu = hashlib.sha256("".join(sums[k] for k in sorted(sums)).encode()).hexdigest()
        rank = {"checksums": sums, "per_gpu_checksum": per_gpu,
                "parallelism_info": {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                                     "pp_size": 1, "rank": 0, "size": 1}}
        engine = hashlib.sha256(per_gpu.encode()).hexdigest()
        return json_response({"success": True, "message": "Success.", "ranks": [rank], "per_engine_checksum": engine})
    else:
        return json_response({"success": False, "message": f"Unsupported action={action!r}"}, 400)
    return json_response({"success": True, "message": "Success."})


async def set_faults(request: web.Request) -> web.Response:
    body = await _body(request, (0, "sim_faults"), required=("faults",))
    faults = body["faults"]
    if not isinstance(faults, list) or any(not isinstance(f, dict) or f.get("kind") not in FAULT_KINDS
                                           for f in faults):
        return json_response({"success": False, "message": f"faults: a list of {{kind: {FAULT_KINDS}}}"}, 400)
    request.app[RL_SIM].faults.extend(faults)
    return json_response({"success": True, "queued": len(request.app[RL_SIM].faults)})


async def list_faults(request: web.Request) -> web.Response:
    rl = request.app[RL_SIM]
    return json_response({"faults": rl.faults, "restarts": rl.restarts})


@web.middleware
async def one_update_at_a_time(request: web.Request, handler) -> web.StreamResponse:
    rl = request.app[RL_SIM]
    if request.path not in UPDATE_PATHS | SESSION_PATHS:
        fault = _take_fault(rl, request.path)
        return await (_faulty(request, handler, fault) if fault else handler(request))
    await request.read()  # read the body before waiting: the caller may give up meanwhile
    async with rl.update_lock:
        return await _faulty(request, handler, _take_fault(rl, request.path))


def _take_fault(rl: RlSim, path: str) -> dict | None:
    """The first fault queued for this route (one without a "path" is for the next weight update)."""
    for i, fault in enumerate(rl.faults):
        if fault.get("path", path if path in UPDATE_PATHS else None) == path:
            return rl.faults.pop(i)
    return None


async def _faulty(request: web.Request, handler, fault: dict | None) -> web.StreamResponse:
    kind = fault and fault["kind"]
    if kind == "fail":
        message = fault.get("message") or "Failed to update weights: injected failure."
        return json_response({"success": False, "message": message}, 400)
    if kind == "partial":
        request[PARTIAL] = fault
    if kind == "delay":
        await asyncio.sleep(float(fault.get("delay_s", 1.0)))
    if kind == "restart":
        return await _restart(request, float(fault.get("restart_s", 0.2)))
    return await handler(request)


async def _restart(request: web.Request, restart_s: float) -> web.StreamResponse:
    """The process dies: in-flight requests and this connection are cut; it comes back as it started."""
    app = request.app
    sim = app[SIM_STATE]
    sim.crashed = True
    sim.notify()
    while sim.running:
        await sim.changed()
    back = asyncio.get_running_loop().create_task(_come_back(app, restart_s))
    app[RL_SIM].tasks.add(back)  # closing the connection cancels this handler, not the comeback
    back.add_done_callback(app[RL_SIM].tasks.discard)
    request.transport.close()
    return web.Response(status=500)  # never reaches the caller: its connection is gone


async def restart_now(request: web.Request) -> web.Response:
    body = await _body(request, (0, "sim_restart"), allow_empty=True)
    app = request.app
    sim = app[SIM_STATE]
    sim.crashed = True
    sim.notify()
    back = asyncio.get_running_loop().create_task(_come_back(app, float(body.get("restart_s", 0.2))))
    app[RL_SIM].tasks.add(back)
    back.add_done_callback(app[RL_SIM].tasks.discard)
    return json_response({"success": True, "message": "restarting"})


async def _come_back(app: web.Application, restart_s: float) -> None:
    await asyncio.sleep(restart_s)
    sim = app[SIM_STATE]
    sim.weight_version, sim.weights_path = sim.config.weight_version, sim.config.model_path
    sim.loaded_from = None
    sim.paused, sim.pause_mode, sim.updating_weights, sim.blocked = False, None, False, None
    sim.prefix_cache = PrefixCache()
    app[WEIGHTS].values = params.initial_params()
    app[WEIGHTS].groups.clear()
    app[WEIGHTS].released.clear()
    app[WEIGHTS].session = None  # a restarted scheduler has no session open
    app[RL_SIM].restarts += 1
    sim.crashed = False
    sim.notify()


ROUTES = (
    ("GET", "/weights_checker", weights_checker),
    ("POST", "/weights_checker", weights_checker),
    ("POST", "/sim/faults", set_faults),
    ("GET", "/sim/faults", list_faults),
    ("POST", "/sim/restart", restart_now),
)


def add_rl_routes(app: web.Application) -> None:
    app[RL_SIM] = RlSim()
    app.middlewares.append(one_update_at_a_time)
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
