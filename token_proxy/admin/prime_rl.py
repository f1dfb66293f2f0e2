"""prime-rl's admin plane (the endpoints prime-rl adds to vLLM), mapped onto SGLang's, on every worker.

One update step as prime-rl drives it: POST /pause everywhere -> the trainer writes or broadcasts
the weights -> POST /update_weights everywhere -> POST /resume (always). Replies are prime-rl's
shapes; a failure is an error naming each failed worker with SGLang's own message.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from aiohttp import web

from token_proxy import checks as check
from token_proxy.admin import bridge_mode, vllm_rl, vllm_weights
from token_proxy.admin.forward import group_bodies, note_group
from token_proxy.admin.labels import OpenUpdate
from token_proxy.errors import BackendTimeout, InvalidRequest, ProxyError
from token_proxy.fleet import transaction as fleet
from token_proxy.fleet.flush import read_pending
from token_proxy.fleet.plane import ADMIN, AdminPlane
from token_proxy.http_io import ROUTE_TABLE, json_response, read_json
from token_proxy.lora.routes import add_lora_admin
from token_proxy.sglang.pause import PRIME_RL, to_sglang
from token_proxy.sglang.workers import WORKERS, WorkerFailed, WorkerReply, Workers, raise_for_failures
from token_proxy.state import CONTEXT, SETTINGS

log = logging.getLogger(__name__)

LIVENESS_TIMEOUT_S = 10.0
NCCL_READY_MARKER = "NCCL_READY"  # prime-rl touches it in weight_dir before an NCCL push
_STEP = re.compile(r"step_(\d+)")


async def pause(request: web.Request) -> web.Response:
    """Two dialects share POST /pause (vllm_rl.py documents the rule): vLLM's names its `mode` or
    `clear_cache` in the query string; anything else (bare, or a JSON body) is prime-rl's."""
    if vllm_rl.is_vllm_pause(request):
        return await vllm_rl.pause(request)
    plane = request.app[ADMIN]
    requested = (await _optional_json(request)).get("mode")
    mode = to_sglang("keep" if requested is None else requested, PRIME_RL, plane.settings.pause_mode)
    await fleet.pause_workers(plane, mode, await plane.worker_urls())
    return json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    """Both dialects. Refused (409) while a weight update runs, and while a failed one holds the workers
    paused (fleet.py)."""
    plane = request.app[ADMIN]
    fleet.refuse_resume(plane, check.query_flag(request.query, "force", False))
    vllm_rl.refuse_resume_while_asleep(request.app)
    await fleet.resume_all(plane, await plane.worker_urls())
    vllm_rl.note_awake(request.app)
    return json_response({"status": "resumed"})


async def update_weights(request: web.Request) -> web.Response:
    """A weight directory -> a fleet update from disk (fleet.py: all workers or none, cache flushed,
    version bumped); null (or prime-rl's NCCL_READY-only directory) -> wait for the trainer's NCCL push
    to land, refused at once (409) when no weight-update group is live. A body with `update_info` is
    vLLM's /update_weights (vllm_weights.py)."""
    plane = request.app[ADMIN]
    body = await read_json(request)
    if vllm_rl.is_vllm_update(body):
        return await vllm_weights.update_weights(request, body)
    weight_dir = body.get("weight_dir")
    nccl = weight_dir is None or _is_nccl_marker_dir(plane, weight_dir)
    if bridge_mode.enabled(request.app) and (nccl or bridge_mode.dialect(request.app) == "primerl"):
        return await _bridge_step(plane, request.app, weight_dir)
    if nccl:
        return await _nccl_step(plane)
    path = check.local_dir(weight_dir, "weight_dir", plane.settings)
    version = str(body.get("weight_version") or _next_version(plane, path))
    await fleet.update_from_disk(plane, path, version, "update_weights", _verify_checksum(body))
    return json_response({"status": "ok", "weight_version": version})


async def _nccl_step(plane: AdminPlane) -> web.Response:
    """The push this call waited for (each push answers one call: a repeat waits for a new one). A failed
    push answers with the status fleet.push_failed chose (503: join again and push again). A push that
    landed some buckets and then stopped is abandoned when the wait runs out: it fails the same way."""
    if not plane.push.waiting():
        vllm_rl.require_group(plane, "update_weights")
    try:
        step = await plane.push.next_step(plane.settings.weight_update_timeout_s)
    except BackendTimeout as timed_out:
        if not plane.push.open:
            raise
        urls = await plane.worker_urls()
        gone = [WorkerReply(url, 0, error=BackendTimeout(f"the push stopped midway: {timed_out.message}"))
                for url in urls]
        try:
            async with plane.transaction():
                await fleet.push_failed(plane, urls, gone, "update_weights (NCCL)")
        except fleet.FleetFailed:
            plane.push.last_step.consumed = True  # this call answers for the abandoned push
            raise
    if not step.ok:
        raise WorkerFailed(step.status, f"update_weights (NCCL) failed: {step.message}")
    return json_response({"status": "ok", "weight_version": step.version})


async def _bridge_step(plane: AdminPlane, app: web.Application, weight_dir) -> web.Response:
    """Bridge mode: prime-rl's push (its weight_dir only names the step: the weights come over NCCL, through
    the bridges), then the version (step N) and the flush, as any update."""
    version = _next_version(plane, weight_dir if isinstance(weight_dir, str) else "")
    mode = app[bridge_mode.BRIDGES]
    if mode.failed_step is not None and mode.failed_step[0] == str(weight_dir):
        raise mode.failed_step[1]  # a retry of the step that failed: the trainer will not send it again
    update = OpenUpdate()  # this call is the whole update: its push opens it, its finish labels it
    try:
        async with plane.transaction():
            update.start(plane)
            await bridge_mode.push(plane, app, "update_weights (weight bridge)")
            await vllm_weights.finish(plane, update, version, "update_weights (weight bridge)")
    except WorkerFailed as exc:
        mode.failed_step = (str(weight_dir), exc)
        raise
    mode.failed_step = None
    return json_response({"status": "ok", "weight_version": version})


def _verify_checksum(body: dict) -> bool:
    """`"verify": "checksum"`: also check every worker reports one weights checksum (/weights_checker)."""
    verify = body.get("verify")
    if verify not in (None, "version", "checksum"):
        raise InvalidRequest(f"verify must be 'version' or 'checksum', got {verify!r}", param="verify")
    return verify == "checksum"


async def reload_weights(request: web.Request) -> web.Response:
    """Older prime-rl: back to the weights the server started with."""
    plane = request.app[ADMIN]
    if not plane.weights.base_model_path:
        raise WorkerFailed(502, "reload_weights: SGLang did not report the model_path it started with")
    await fleet.update_from_disk(plane, plane.weights.base_model_path, plane.weights.initial_version, "reload_weights")
    return json_response({"status": "ok", "weight_version": plane.weights.initial_version})


def _is_nccl_marker_dir(plane: AdminPlane, weight_dir) -> bool:
    if not plane.settings.check_local_paths or not isinstance(weight_dir, str):
        return False
    check.path(weight_dir, "weight_dir")  # a name too long for the file system: a 400, not an OSError
    directory = Path(weight_dir)
    return (directory / NCCL_READY_MARKER).exists() and not any(directory.glob("*.safetensors"))


def _next_version(plane: AdminPlane, path: str) -> str:
    """prime-rl writes step N to .../step_N: that N; otherwise one past the current number."""
    steps = _STEP.findall(path)
    if steps:
        return steps[-1]
    current = plane.weights.version or ""
    return str(int(current) + 1) if current.isdigit() else str(len(plane.weights.history) + 1)


async def init_broadcaster(request: web.Request) -> web.Response:
    """prime-rl: trainer rank 0, inference ranks rank_offset + local_gpu + 1, world size
    inference_world_size + 1 -> SGLang: rank_offset + 1 (its ranks are rank_offset + tp_rank)."""
    plane = request.app[ADMIN]
    body = await read_json(request)
    if body.get("quantize_in_weight_transfer"):
        raise InvalidRequest("quantize_in_weight_transfer is not supported by SGLang's weight-update group",
                             param="quantize_in_weight_transfer")
    rank_offset = body.get("rank_offset", body.get("server_rank", 0))
    inference_world_size = body.get("inference_world_size", body.get("num_inference_server"))
    check.integer(rank_offset, "rank_offset", 0)
    check.integer(inference_world_size, "inference_world_size", 1)
    check.host(body.get("host"), "host")  # prime-rl's names, checked before they become SGLang's
    check.port(body.get("port"), "port")
    timeout_s = check.seconds(body.get("timeout"), "timeout", plane.settings.init_group_timeout_s)
    if bridge_mode.enabled(request.app):  # prime-rl's receiving ranks: rank_offset + 1 .. in a world of W + 1
        await bridge_mode.join(plane, request.app, "primerl", {"host": body["host"], "port": body["port"]},
                               inference_world_size + 1, rank_offset + 1, timeout_s)
        return json_response({"status": "ok"})
    native = {"master_address": body.get("host"), "master_port": body.get("port"),
              "rank_offset": rank_offset + 1, "world_size": inference_world_size + 1,
              "group_name": body.get("group_name", "weight_update_group"), "backend": body.get("backend", "nccl")}
    urls = await plane.worker_urls()
    bodies = await group_bodies(plane, native, urls)
    async with plane.transaction():
        replies = await plane.fan_out("POST", "/init_weights_update_group", bodies, timeout_s, urls)
    raise_for_failures("init_broadcaster", replies)
    note_group(plane, native, replies)
    return json_response({"status": "ok"})


async def liveness(request: web.Request) -> web.Response:
    """Every worker's scheduler answers (/v1/loads goes through it, paused or not) within 10 s."""
    plane = request.app[ADMIN]
    try:
        replies = await read_pending(plane, await plane.worker_urls(), LIVENESS_TIMEOUT_S)
    except ProxyError as exc:
        return json_response({"status": "engine_unresponsive", "message": exc.message}, status=503)
    dead = [r for r in replies if not r.ok]
    if dead:
        message = "; ".join(f"{r.url}: {r.message}" for r in dead)
        return json_response({"status": "engine_unresponsive", "message": message}, status=503)
    return json_response({"status": "ok"})


async def _optional_json(request: web.Request) -> dict:
    return await read_json(request) if (await request.read()).strip() else {}


def add_admin_state(app: web.Application) -> None:
    """What the admin plane's routes (routes.py's rows: prime-rl's, vLLM's, LoRA's, SGLang's) use:
    the worker fan-out, then the LoRA admin on top of it, and the vLLM dialect's state."""
    app.cleanup_ctx.append(_admin_plane)
    bridge_mode.add_bridge_mode(app, app[SETTINGS].weight_bridges)
    vllm_rl.add_vllm_rl_state(app)
    add_lora_admin(app)


async def _admin_plane(app: web.Application):
    ctx = app[CONTEXT]
    view = ctx.connection.view  # the fleet's one live view: the fan-out lists the workers there
    workers = app[WORKERS] = Workers(settings=ctx.settings, client=ctx.client, spawn=ctx.spawn, view=view)
    version_keys = {path: row.version_key for path, row in app[ROUTE_TABLE].items() if row.version_key}
    plane = app[ADMIN] = AdminPlane(settings=ctx.settings, workers=workers, version_keys=version_keys)

    def learn(backend) -> None:  # once SGLang is known (start-up may come before it): fleet/start.py's rule
        plane.learn_start(backend, view.snapshot().workers)

    ctx.when_ready(learn)
    yield
