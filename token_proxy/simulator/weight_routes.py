"""SGLang's weight-sync and memory endpoints: a real torch.distributed group join and receive
(gloo on CPU), parameters readable by name, and memory release/resume (LoRA adapters: lora.py)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiohttp import web

from token_proxy.simulator import params
from token_proxy.simulator.admin_routes import (
    CRASH,
    FLUSH_REFUSED,
    REFUSED,
    _body,
    _drain,
    crash_scheduler,
    flush_outcome,
)
from token_proxy.simulator.errors import json_response
from token_proxy.simulator.state import SIM_STATE, SimState

log = logging.getLogger(__name__)

ALL_MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES: no tags = all
GROUP_FAILED = "Failed to initialize custom process group: {}."
# torch 2.11's _new_process_group_helper (SGLang 0.5.17 pins it): a name still registered, e.g. the group of a
# push that failed and was never destroyed, cannot be joined again until /destroy_weights_update_group.
GROUP_NAME_USED = "The specified group name has already been used, please use a different group name"
# What an NCCL receive that breaks midway raises (the simulator's `partial` fault, unless it names another).
RECEIVE_BROKE = "NCCL error: remote process exited or there was a network error"
UPDATE_FAILED = ("Failed to update parameter online: {}. The full weights of the ModelRunner are partially "
                 "updated. Please discard the whole weights.")
# 0.5.21+ (managers/scheduler_components/weight_updater.py): the receive is its own step, and distributed /
# tensor updates need the weight-update session (upstream PR #28001).
RECEIVE_FAILED = "Failed to receive weights: {}"
NO_SESSION = "{} must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_TO_END = "no weight-update session is open; call begin_weight_update() first"
SESSION_SINCE = "0.5.21"
IDLE_IGNORES_WAITING_SINCE = "0.5.21"  # scheduler_components/weight_updater.py: is_fully_idle(ignore_waiting=...)
PARTIAL: web.RequestKey[dict] = web.RequestKey("sim_partial_fault", dict)  # set by rl_routes.py's `partial` fault


@dataclass
class Weights:
    """What the simulated model runner holds besides the fake forward pass."""

    values: dict = field(default_factory=params.initial_params)  # name -> nested list or torch tensor
    groups: dict = field(default_factory=dict)  # group_name -> torch process group
    released: set[str] = field(default_factory=set)  # memory tags released
    updates: list[dict] = field(default_factory=list)  # every distributed update received, in order
    # 0.5.21+: the open weight-update session ({"selector", "loaded_weights"}), None when closed; and
    # every begin / end the server answered, in order (tests read the bracket from it).
    session: dict | None = None
    session_log: list[str] = field(default_factory=list)


WEIGHTS: web.AppKey[Weights] = web.AppKey("sim_weights", Weights)


def _weights(request: web.Request) -> Weights:
    return request.app[WEIGHTS]


def _result(success: bool, message: str) -> web.Response:
    return json_response({"success": success, "message": message}, 200 if success else 400)


async def init_weights_update_group(request: web.Request) -> web.Response:
    required = ("master_address", "master_port", "rank_offset", "world_size")
    body = await _body(request, (1321, "init_weights_update_group"), required=required)
    group_name = body.get("group_name", "weight_update_group")
    rank = body["rank_offset"]  # tp_rank 0: the simulator is one GPU
    if group_name in _weights(request).groups:
        return _result(False, GROUP_FAILED.format(GROUP_NAME_USED))
    log.info("init custom process group: master_address=%s, master_port=%s, rank=%s, world_size=%s, "
             "group_name=%s, backend=%s", body["master_address"], body["master_port"], rank, body["world_size"],
             group_name, body.get("backend", "nccl"))
    sim = request.app[SIM_STATE]
    sim.blocked = blocked = f"init_weights_update_group {group_name!r} ({id(body):x})"
    try:
        group = await asyncio.to_thread(
            params.join_group, body["master_address"], body["master_port"], rank, body["world_size"],
            group_name, body.get("backend", "nccl"), sim.config.dist_timeout_s)
    except ImportError:
        return _result(False, GROUP_FAILED.format("torch is not installed in the simulator"))
    except Exception as exc:  # noqa: BLE001 - torch's own words, as SGLang reports them
        return _result(False, GROUP_FAILED.format(exc))
    finally:
        still_ours = sim.blocked == blocked
        _unblock(sim, blocked)
    if not still_ours:  # the process restarted meanwhile (rl_routes.py): the group died with the old one
        await asyncio.to_thread(params.leave_group, group)
        return _result(False, GROUP_FAILED.format("the server restarted during the join"))
    _weights(request).groups[group_name] = group
    return _result(True, "Succeeded to initialize custom process group.")


def _unblock(sim: SimState, blocked: str) -> None:
    """The scheduler serves again (scheduler_block.py); a restart meanwhile already cleared it."""
    if sim.blocked == blocked:
        sim.blocked = None
        sim.notify()


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = await _body(request, (1375, "update_weights_from_distributed"), required=("names", "dtypes", "shapes"))
    sim, weights = request.app[SIM_STATE], _weights(request)
    group_name = body.get("group_name", "weight_update_group")
    missing_group = (f"Group {group_name} not in {list(weights.groups)}. Please call "
                     "`init_weights_update_group` first.")
    gated = sim.config.since(SESSION_SINCE)
    if group_name not in weights.groups and not gated:
        return _result(False, missing_group)
    if body.get("abort_all_requests"):
        sim.abort(abort_all=True)
    if not sim.paused:
        await _drain(sim)
    if gated:  # the scheduler's checks, in its order: the session, then the receive (group first)
        if weights.session is None:
            return _result(False, NO_SESSION.format("update_weights_from_distributed"))
        if group_name not in weights.groups:
            return _result(False, RECEIVE_FAILED.format(missing_group))
    try:
        tensors = await asyncio.to_thread(params.receive, weights.groups[group_name], body["dtypes"], body["shapes"])
    except Exception as exc:  # noqa: BLE001 - SGLang turns any receive failure into a reply
        return _result(False, (RECEIVE_FAILED if gated else UPDATE_FAILED).format(exc))
    fault = request.get(PARTIAL)
    if fault is not None:  # the receive broke midway: what arrived is loaded, the rest stays old
        half = len(body["names"]) // 2
        _load(weights, body["names"][:half], tensors[:half])
        sim.weights_path = f"partial:{params.digest(tensors[:half])}"
        return _result(False, UPDATE_FAILED.format(fault.get("message") or RECEIVE_BROKE))
    try:
        _load(weights, body["names"], tensors)
    except Exception as exc:  # noqa: BLE001 - SGLang turns any load failure into this reply
        return _result(False, UPDATE_FAILED.format(exc))
    if gated:
        weights.session["loaded_weights"] = True
    flush = flush_outcome(sim, body)
    if flush == CRASH:
        return crash_scheduler(sim)
    weights.updates.append({"names": list(body["names"]), "weight_version": body.get("weight_version")})
    sim.weights_path = f"distributed:{params.digest(tensors)}"
    if flush == REFUSED:
        return _result(False, FLUSH_REFUSED)
    return _result(True, "Succeeded to update parameter online." + _after_update(sim, body))


def _load(weights: Weights, names: list[str], tensors: list) -> None:
    """Qwen2's load_weights: each name must exist with the same shape; earlier ones stay loaded."""
    for name, tensor in zip(names, tensors):
        if name not in params.PARAM_SHAPES:
            raise KeyError(name)
        expected = params.PARAM_SHAPES[name]
        if tuple(tensor.shape) != expected:
            raise AssertionError(f"Attempted to load weight (torch.Size({list(tensor.shape)})) into parameter "
                                 f"(torch.Size({list(expected)}))")
        weights.values[name] = tensor


def _after_update(sim: SimState, body: dict) -> str:
    if body.get("flush_cache", True):
        sim.prefix_cache.clear()
    if body.get("weight_version") is None:
        return ""
    sim.weight_version = str(body["weight_version"])
    return f" Weight version updated to {sim.weight_version}."


async def begin_weight_update(request: web.Request) -> web.Response:
    """0.5.21+: open the session (BeginWeightUpdateReqInput: `selector`, default "all")."""
    body = await _body(request, (1460, "begin_weight_update"))
    weights = _weights(request)
    if not request.app[SIM_STATE].paused:
        await _drain(request.app[SIM_STATE])  # the tokenizer manager's writer lock, as for an update
    if weights.session is not None:
        weights.session_log.append("begin refused")
        return _result(False, SESSION_OPEN)
    weights.session = {"selector": body.get("selector", "all"), "loaded_weights": False}
    weights.session_log.append("begin")
    return _result(True, "Success")


async def end_weight_update(request: web.Request) -> web.Response:
    """0.5.21+: close the session begin opened (EndWeightUpdateReqInput has no fields of its own)."""
    await _body(request, (1475, "end_weight_update"))
    weights = _weights(request)
    if not request.app[SIM_STATE].paused:
        await _drain(request.app[SIM_STATE])
    if weights.session is None:
        weights.session_log.append("end refused")
        return _result(False, NO_SESSION_TO_END)
    weights.session = None
    weights.session_log.append("end")
    return _result(True, "Success")


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await _body(request, (1337, "destroy_weights_update_group"), allow_empty=True)
    group = _weights(request).groups.pop(body.get("group_name", "weight_update_group"), None)
    if group is None:
        return _result(False, "The group to be destroyed does not exist.")
    try:
        await asyncio.to_thread(params.leave_group, group)
    except Exception as exc:  # noqa: BLE001 - as SGLang's destroy_weights_update_group
        return _result(False, f"Failed to destroy custom process group: {exc}.")
    return _result(True, "Succeeded to destroy custom process group.")


async def get_weights_by_name(request: web.Request) -> web.Response:
    body = await _body(request, (1448, "get_weights_by_name"), required=("name",))
    value = _weights(request).values.get(body["name"])
    if value is None:
        return json_response({"error": {"message": f"Parameter {body['name']} not found"}}, 400)
    return json_response(params.as_list(value, int(body.get("truncate_size", 100))))


async def release_memory_occupation(request: web.Request) -> web.Response:
    body = await _body(request, (1464, "release_memory_occupation"), allow_empty=True)
    if not _fully_idle(request.app[SIM_STATE]):  # the scheduler asserts is_fully_idle(): the server dies
        return crash_scheduler(request.app[SIM_STATE])
    _weights(request).released |= set(body.get("tags") or ALL_MEMORY_TAGS)
    return json_response(None)  # FastAPI's reply for a handler that returns None


def _fully_idle(sim: SimState) -> bool:
    """The scheduler's is_fully_idle() as release_memory_occupation asks it: nothing running and nothing
    waiting (0.5.17-0.5.20); since 0.5.21 a paused engine's waiting queue is ignored (ignore_waiting=
    scheduler._engine_paused), so requests queued behind a pause do not count, a running one still does."""
    if sim.paused and sim.config.since(IDLE_IGNORES_WAITING_SINCE):
        return sim.active == 0
    return not sim.running


async def resume_memory_occupation(request: web.Request) -> web.Response:
    body = await _body(request, (1476, "resume_memory_occupation"), allow_empty=True)
    tags, weights = set(body.get("tags") or ALL_MEMORY_TAGS), _weights(request)
    if not tags <= weights.released:  # the scheduler's offload_tags.remove(tag) raises KeyError and it dies
        return crash_scheduler(request.app[SIM_STATE])
    weights.released -= tags
    return json_response(None)


ROUTES = (
    ("POST", "/init_weights_update_group", init_weights_update_group),
    ("POST", "/update_weights_from_distributed", update_weights_from_distributed),
    ("POST", "/destroy_weights_update_group", destroy_weights_update_group),
    ("GET", "/get_weights_by_name", get_weights_by_name),
    ("POST", "/get_weights_by_name", get_weights_by_name),
    ("GET", "/release_memory_occupation", release_memory_occupation),
    ("POST", "/release_memory_occupation", release_memory_occupation),
    ("GET", "/resume_memory_occupation", resume_memory_occupation),
    ("POST", "/resume_memory_occupation", resume_memory_occupation),
)


SESSION_ROUTES = (
    ("POST", "/begin_weight_update", begin_weight_update),
    ("POST", "/end_weight_update", end_weight_update),
)


def add_weight_routes(app: web.Application) -> None:
    weights = app[WEIGHTS] = Weights()
    app[SIM_STATE].on_disk_load.append(lambda: setattr(weights, "values", params.initial_params()))
    since_0521 = SESSION_ROUTES if app[SIM_STATE].config.since(SESSION_SINCE) else ()
    for method, path, handler in (*ROUTES, *since_0521):
        app.router.add_route(method, path, handler)
