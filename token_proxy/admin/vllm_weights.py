"""vLLM 0.33's weight-transfer routes on SGLang (the table's NCCL rows in vllm_rl.py): the weight-update
group (init / shutdown), one update (start, update_weights per chunk, finish: version, verify, flush),
and the weight read-outs (weight_info, weight_checker, get_world_size, SkyRL's collective_rpc). Every
NCCL step answers 409 at once when no weight-update group is live (vllm_rl.require_group)."""

from __future__ import annotations

from aiohttp import web

from token_proxy import checks as check
from token_proxy.admin import bridge_mode
from token_proxy.admin.forward import group_bodies, note_group, note_group_gone
from token_proxy.admin.labels import UPDATE, OpenUpdate
from token_proxy.admin.vllm_rl import VLLM_RL, NotImplementedBySGLang, VllmRlState, require_group
from token_proxy.errors import InvalidRequest
from token_proxy.fleet import transaction as fleet
from token_proxy.fleet import weight_session
from token_proxy.fleet.fence import fence_info
from token_proxy.fleet.flush import flush_or_owe
from token_proxy.fleet.plane import ADMIN, AdminPlane
from token_proxy.http_io import json_response, read_json
from token_proxy.sglang.workers import raise_for_failures, server_infos

GROUP = "weight_update_group"
SKYRL_RPC = ("skyrl_start_weight_update", "update_weights_nccl", "skyrl_finish_weight_update")


async def init_weight_transfer_engine(request: web.Request) -> web.Response:
    plane = request.app[ADMIN]
    info = json_object((await read_json(request)).get("init_info"), "init_info")
    if info.get("nccl_unique_id_b64"):
        raise NotImplementedBySGLang("init_info.nccl_unique_id_b64: SGLang's init_weights_update_group joins "
                                     "through a torch.distributed TCP rendezvous (master_address, master_port), not "
                                     "a pre-minted ncclUniqueId")
    if bridge_mode.enabled(request.app):
        return await _bridge_init(plane, request.app, info)
    _refuse_packed(info, "init_info")
    native = {"master_address": info.get("master_address"), "master_port": info.get("master_port"),
              "rank_offset": info.get("rank_offset", 1), "world_size": info.get("world_size"),
              "group_name": GROUP, "backend": info.get("backend", "nccl")}
    urls = await plane.worker_urls()
    bodies = await group_bodies(plane, native, urls)
    async with plane.transaction():
        replies = await plane.fan_out("POST", "/init_weights_update_group", bodies,
                                      plane.settings.init_group_timeout_s, urls)
    raise_for_failures("init_weight_transfer_engine", replies)
    note_group(plane, native, replies)
    return json_response({"message": "Weight transfer initialized"})


async def _bridge_init(plane: AdminPlane, app: web.Application, info: dict) -> web.Response:
    """Bridge mode: the bridges join as vLLM's workers would (ranks rank_offset .. world_size - 1), and keep
    the trainer's packed geometry to cut its chunks as vLLM's consumer does."""
    check.host(info.get("master_address"), "init_info.master_address")
    check.port(info.get("master_port"), "init_info.master_port")
    check.integer(info.get("world_size"), "init_info.world_size", 2)
    check.integer(info.get("rank_offset", 1), "init_info.rank_offset", 1)
    mode = app[bridge_mode.BRIDGES]
    mode.packed = bool(info.get("packed", False))  # vLLM's worker-side default; the trainer ships its own
    mode.buffer_size_bytes = info.get("packed_buffer_size_bytes", 1 << 30)
    check.integer(mode.buffer_size_bytes, "init_info.packed_buffer_size_bytes", 1)
    trainer = {"host": info["master_address"], "port": info["master_port"]}
    await bridge_mode.join(plane, app, "vllm", trainer, info["world_size"], info.get("rank_offset", 1),
                           plane.settings.init_group_timeout_s)
    return json_response({"message": "Weight transfer initialized"})


async def shutdown_weight_transfer_engine(request: web.Request) -> web.Response:
    plane = request.app[ADMIN]
    if bridge_mode.enabled(request.app):
        await bridge_mode.leave(plane, request.app)
        return json_response({"message": "Weight transfer shut down"})
    replies = await plane.fan_out("POST", "/destroy_weights_update_group", {"group_name": GROUP},
                                  plane.settings.admin_timeout_s)
    note_group_gone(plane, {"group_name": GROUP}, replies)
    raise_for_failures("shutdown_weight_transfer_engine", replies)
    return json_response({"message": "Weight transfer shut down"})


async def start_weight_update(request: web.Request) -> web.Response:
    require_group(request.app[ADMIN], "start_weight_update")
    request.app[UPDATE].start(request.app[ADMIN])
    return json_response({"message": "Weight update started"})


async def start_draft_weight_update(request: web.Request) -> web.Response:
    raise NotImplementedBySGLang("start_draft_weight_update: SGLang's update_weights_from_distributed has no "
                                 "draft-model target")


async def update_weights(request: web.Request, body: dict) -> web.Response:
    """vLLM's /update_weights (routes.py hands it over): each update_info is one broadcast from rank 0,
    received by every worker through /update_weights_from_distributed while this call is open."""
    plane, state = request.app[ADMIN], request.app[VLLM_RL]
    if bridge_mode.enabled(request.app):  # one push: the trainer's whole model, decoded by the bridges
        info = json_object(body["update_info"], "update_info")
        async with plane.transaction():
            await bridge_mode.push(plane, request.app, "update_weights (weight bridge)", info)
        return json_response({"message": "Weights updated"})
    infos = body["update_info"] if isinstance(body["update_info"], list) else [body["update_info"]]
    metas = [_meta(state, json_object(info, "update_info")) for info in infos]
    require_group(plane, "update_weights")
    async with plane.transaction():
        for meta in metas:
            await receive(plane, meta, "update_weights")
    request.app[UPDATE].start(plane)  # every worker took it: a finish may label it (labels.py)
    return json_response({"message": "Weights updated"})


async def receive(plane: AdminPlane, meta: dict, action: str) -> None:
    urls = await plane.worker_urls()
    body = {**meta, "group_name": GROUP, "flush_cache": False}  # the flush comes once, at finish

    def push():  # the first worker to fail ends it: its refusal reaches the trainer at once
        return plane.fan_out_until_failure("POST", "/update_weights_from_distributed", body,
                                           plane.settings.weight_update_timeout_s, urls)

    # SGLang 0.5.21+ takes the push only inside a weight-update session, closed before any rollback.
    replies = await weight_session.bracketed(plane, urls, push, action)
    if not all(r.ok for r in replies):
        # The workers hold partly updated weights (SGLang: "discard the whole weights"): every dialect's
        # failed push ends in one place (groups destroyed, rolled back or held).
        await fleet.push_failed(plane, urls, replies, action)
    plane.weights.loaded_path = None  # the weights now came over NCCL: no checkpoint on disk holds them
    if plane.control.hold is not None:
        plane.control.hold["received"] = True  # every worker took this push: a finish may now end the hold


def _meta(state: VllmRlState, info: dict) -> dict:
    if info.get("ipc_handles") is not None or info.get("ipc_handles_pickled") is not None:
        raise NotImplementedBySGLang("update_info.ipc_handles: SGLang's update_weights_from_ipc does not take "
                                     "vLLM's CUDA IPC handles")
    _refuse_packed(info, "update_info")
    names, dtypes, shapes = info.get("names") or [], info.get("dtype_names") or [], info.get("shapes") or []
    if not (names or dtypes or shapes):
        if state.last_meta is None:
            raise InvalidRequest("update_info.names is empty and no earlier update's metadata can be reused",
                                 param="update_info.names")
        return state.last_meta
    meta = {"names": names, "dtypes": dtypes, "shapes": shapes}
    check.tensor_specs(meta)
    state.last_meta = meta
    return meta


def _refuse_packed(info: dict, param: str) -> None:
    if info.get("packed"):
        raise NotImplementedBySGLang(
            f"{param}.packed: SGLang's update_weights_from_distributed receives one broadcast per tensor, not vLLM's "
            "packed buffers; send with packed=false (token_proxy.broadcast.SGLangBroadcaster does)")


async def finish_weight_update(request: web.Request) -> web.Response:
    """Set the version everywhere, check every worker reports it, then flush (or owe the flush)."""
    plane = request.app[ADMIN]
    raw = await request.read()
    body = await read_json(request) if raw.strip() and raw.strip() != b"null" else {}
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise InvalidRequest(f"weight_version must be a string, got {version!r}", param="weight_version")
    async with plane.transaction():
        await finish(plane, request.app[UPDATE], version, "finish_weight_update")
    return json_response({"message": "Weight update finished"})


async def finish(plane: AdminPlane, update: OpenUpdate, version: str | None, action: str) -> None:
    """Refused (409) while a failed receive holds the fleet: setting one version string on workers holding
    different weights would end the hold on a lie. A successful receive since then lifts that. Refused (409)
    too when no update is open, or the open one failed (labels.py)."""
    if plane.control.hold is not None and not plane.control.hold.get("received"):
        raise fleet.Conflict(f"{action}: the workers are held paused after a failed weight update "
                             f"({plane.control.hold['message']}); send the weights again (every worker must receive "
                             "them) before finishing, or POST /resume?force=true to serve anyway")
    update.refuse_finish(plane, action)
    urls = await plane.worker_urls()
    if version is not None:
        # SGLang's abort_all_requests defaults to true (every release in bench/sglang_versions.json): the
        # rollouts a /pause?mode=keep kept must finish, not be aborted.
        replies = await plane.fan_out("POST", "/update_weight_version",
                                      {"new_version": version, "abort_all_requests": False},
                                      plane.settings.admin_timeout_s, urls)
        if not all(r.ok for r in replies):
            await fleet.recover(plane, urls, replies, action, every_worker_changed=True)
    versions = await fleet.read_versions(plane, urls)
    if len(set(versions.values())) != 1 or (version is not None and versions[urls[0]] != version):
        stand_ins = [fleet.stand_in(url) for url in urls]
        await fleet.recover(plane, urls, stand_ins, action, every_worker_changed=True, expected=version)
    plane.record_version(version or versions[urls[0]])
    fleet.set_hold(plane, None)
    update.finish()
    await flush_or_owe(plane, urls)


async def weight_info(request: web.Request) -> web.Response:
    """vLLM's {"weight_version"}; with several workers also each one's, and whether they agree. While a
    failed update holds the fleet it is inconsistent whatever the versions say, naming each worker whose
    weights that update may have left partial (`partial`) and why (`held`)."""
    plane = request.app[ADMIN]
    workers = await fleet.gather_versions(plane)
    versions = {w["weight_version"] for w in workers}
    consistent = len(versions) == 1 and plane.control.hold is None
    reply = {"weight_version": next(iter(versions)) if consistent else None, "consistent": consistent,
             "workers": workers}
    if plane.control.hold is not None:  # a failed update: the version strings may agree, the weights do not
        changed = set(plane.control.hold.get("changed") or ())
        for worker in workers:
            worker["partial"] = worker["url"] in changed
        reply["held"] = plane.control.hold["message"]
    # `joining`: each worker inside a weight-update group join SGLang has not answered yet (fleet/joins.py)
    return json_response({**reply, **fence_info(request.app), "joining": plane.joins.info()})


async def weight_checker(request: web.Request) -> web.Response:
    plane = request.app[ADMIN]
    body = await read_json(request)
    action, baseline = body.get("action"), body.get("baseline")
    if action not in ("checksum", "reset", "compare"):
        raise InvalidRequest(f"action must be checksum, reset or compare, got {action!r}", param="action")
    if action == "compare" and not isinstance(baseline, dict):
        raise InvalidRequest("action='compare' requires a 'baseline' object", param="baseline")
    native = "reset_tensors" if action == "reset" else "checksum"
    replies = await plane.fan_out("POST", "/weights_checker", {"action": native}, plane.settings.admin_timeout_s)
    if any(r.status == 404 for r in replies):
        raise NotImplementedBySGLang("weight_checker: the workers have no /weights_checker (SGLang < 0.5.17)")
    raise_for_failures("weight_checker", replies)
    if action == "reset":
        return json_response({"status": "reset"})
    per_worker = [_checksums(r.body) for r in replies]
    if action == "checksum":
        engines = [r.body.get("per_engine_checksum") for r in replies]
        return json_response({"checksums": per_worker[0], "consistent": len(set(engines)) == 1,
                              "workers": [{"url": r.url, "per_engine_checksum": e} for r, e in zip(replies, engines)]})
    mismatches = sorted({key for sums in per_worker for key in sums.keys() | baseline.keys()
                         if sums.get(key) != baseline.get(key)})
    return json_response({"match": not mismatches, "mismatches": mismatches})


def _checksums(body: dict) -> dict[str, str]:
    """One worker's ranks merged as vLLM does; with several TP ranks each name is prefixed by its rank."""
    ranks = body.get("ranks") or []
    if len(ranks) == 1:
        return dict(ranks[0].get("checksums") or {})
    return {f"tp{rank.get('parallelism_info', {}).get('tp_rank', i)}.{name}": value
            for i, rank in enumerate(ranks) for name, value in (rank.get("checksums") or {}).items()}


async def get_world_size(request: web.Request) -> web.Response:
    """The ranks of every worker behind the proxy: one URL stands for the whole fleet."""
    plane = request.app[ADMIN]
    include_dp = check.query_flag(request.query, "include_dp", True)
    urls = await plane.worker_urls()
    size = 0
    for info in await server_infos(plane, urls):
        size += (info.get("tp_size") or 1) * (info.get("pp_size") or 1) * (
            (info.get("dp_size") or 1) if include_dp else 1)
    return json_response({"world_size": size})


async def collective_rpc(request: web.Request) -> web.Response:
    """SGLang runs no vLLM worker code; SkyRL's three weight-sync methods map onto the routes above."""
    plane = request.app[ADMIN]
    body = await read_json(request)
    method, kwargs = body.get("method"), body.get("kwargs") or {}
    if not isinstance(method, str) or not method:
        raise InvalidRequest("Missing 'method' in request body", param="method")
    if method not in SKYRL_RPC:
        raise NotImplementedBySGLang(f"collective_rpc {method!r}: SGLang has no collective_rpc (it runs no vLLM "
                                     f"worker extension); only {', '.join(SKYRL_RPC)} are mapped")
    update = request.app[UPDATE]
    if method == "skyrl_start_weight_update":
        require_group(plane, method)
        update.start(plane)
    elif method == "update_weights_nccl":
        meta = _meta(request.app[VLLM_RL], json_object(kwargs.get("update_info"), "kwargs.update_info"))
        require_group(plane, method)
        async with plane.transaction():
            await receive(plane, meta, method)
        update.start(plane)
    else:
        async with plane.transaction():
            await finish(plane, update, None, method)
    return json_response({"results": [None] * len(await plane.worker_urls())})


def json_object(value, param: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param} must be a JSON object", param=param)
    return value
