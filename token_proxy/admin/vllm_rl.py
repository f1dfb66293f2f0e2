"""vLLM 0.33's RL admin API (its RLHF router and dev sleep/cache routes, VLLM_SERVER_DEV_MODE=1) on SGLang,
in vLLM's request and reply shapes, on every worker behind the proxy.

| vLLM route | SGLang |
|---|---|
| POST /pause ?mode=abort|wait|keep&clear_cache | /pause_generation abort / (drain, then in_place) / --pause-mode; /flush_cache |
| POST /resume, GET /is_paused | /continue_generation (409 while an update runs); the proxy's record |
| POST /abort_requests {"request_ids"} | /abort_request {"rid"} for each SGLang rid of each id, or {"abort_all": true} |
| POST /sleep ?level=0|1|2&mode | pause, then /release_memory_occupation (all tags) once idle |
| POST /wake_up ?tags=weights&tags=kv_cache , GET /is_sleeping | /resume_memory_occupation {"tags"}; /continue_generation once all is back, if /sleep paused |
| POST /release_kv_cache_memory | /release_memory_occupation {"tags": ["kv_cache", "cuda_graph"]} |
| POST /reset_prefix_cache | /flush_cache (a busy worker is owed it: flush.py) |
| POST /init_weight_transfer_engine {"init_info"} | /init_weights_update_group (each worker its own rank_offset) |
| POST /shutdown_weight_transfer_engine | /destroy_weights_update_group |
| POST /start_weight_update, /update_weights {"update_info"}, /finish_weight_update {"weight_version"} | /update_weights_from_distributed per update (0.5.21+: inside /begin_weight_update … /end_weight_update); /update_weight_version, verify, flush |
| POST /update_weight_version {"new_version"} | forwarded as is (SGLang's route has the same name and body) |
| GET /weight_info | /model_info weight_version of every worker |
| POST /weight_checker {"action", "baseline"} | /weights_checker checksum / reset_tensors |
| GET /get_world_size ?include_dp | /server_info tp_size x pp_size (x dp_size), summed over the workers |
| POST /collective_rpc | SkyRL's three weight-sync methods only |

What SGLang cannot do is a 501 naming the missing capability, never a quiet success: `wait` is emulated
(SGLang has no drain-only pause: the proxy waits until every worker is idle, then pauses in place, and
requests arriving meanwhile are admitted and waited for too); sleeping with `mode=keep` (SGLang releases
memory only when idle: its scheduler asserts); level 1 without --enable-weights-cpu-backup (SGLang would
discard the weights, which is level 2); any level >= 1 without --enable-memory-saver (the release would
be a no-op); an ncclUniqueId rendezvous; vLLM's packed broadcast buffers; CUDA IPC handles; draft-model
updates; reset_running_requests / reset_external; any other collective_rpc method.

Dialects. POST /pause and POST /update_weights are also prime-rl's (prime_rl.py), told apart thus:
- /pause is vLLM's when its query string names `mode` or `clear_cache` (vLLM reads only the query);
  a bare POST /pause, or one with a JSON body, is prime-rl's (keep in-flight requests, --pause-mode).
  So a bare POST means prime-rl's keep, not vLLM's default abort: vLLM clients that want abort say so.
- /update_weights is vLLM's when the body has `update_info`; otherwise prime-rl's (`weight_dir`: a
  directory to load, or null: an NCCL push).
Every NCCL step, in either dialect, answers 409 at once when no weight-update group is live.

This module serves pause, sleep and the cache rows; the weight-transfer rows (init / shutdown, the
update steps, weight_info, weight_checker, get_world_size, collective_rpc) are vllm_weights.py's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web

from token_proxy import checks as check
from token_proxy.admin import memory as memory_ops
from token_proxy.admin.labels import add_label_state
from token_proxy.admin.memory import MEMORY, Memory, add_memory_state, wait_idle
from token_proxy.errors import InvalidRequest
from token_proxy.fleet import transaction as fleet
from token_proxy.fleet.flush import flush_or_owe, pending, read_pending
from token_proxy.fleet.plane import ADMIN, AdminPlane
from token_proxy.http_io import json_response, read_json
from token_proxy.sglang.pause import VLLM, checked_mode, to_sglang
from token_proxy.sglang.workers import WorkerFailed, failure_status, raise_for_failures, server_infos
from token_proxy.state import CONTEXT

log = logging.getLogger(__name__)

# vLLM's executor sleeps these two (SLEEP_TAGS) and serves once both are awake. SGLang also releases its CUDA
# graphs' memory, which vLLM does not name: it goes and comes back with kv_cache, so that weights alone can be
# woken to receive an update while the trainer still holds the GPU (SkyRL's and slime's order), and kv_cache
# then brings back everything needed to serve.
SLEEP_TAGS = {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}  # vLLM's tag -> SGLang's
WAKE_TAGS = (*SLEEP_TAGS, "scheduling")


class NotImplementedBySGLang(WorkerFailed):
    """vLLM asked for something SGLang cannot do: 501 naming what is missing."""

    type = "NotImplementedError"

    def __init__(self, message: str):
        super().__init__(501, message)


@dataclass
class VllmRlState:
    asleep: bool = False  # /sleep paused the fleet; /wake_up resumes it once everything is back
    last_meta: dict | None = None  # the names / dtypes / shapes of the last update (vLLM reuses them)


VLLM_RL: web.AppKey[VllmRlState] = web.AppKey("vllm_rl", VllmRlState)


# --- dialects and the fail-fast rule --------------------------------------------------------------

def is_vllm_pause(request: web.Request) -> bool:
    return "mode" in request.query or "clear_cache" in request.query


def is_vllm_update(body: dict) -> bool:
    return "update_info" in body


def require_group(plane: AdminPlane, action: str) -> None:
    """An NCCL step needs a live weight-update group, or nothing can ever arrive: 409 at once."""
    if not plane.push.live_groups:
        raise fleet.Conflict(
            f"{action}: no weight-update group is live, so no NCCL push can reach the workers. Join one first "
            "(prime-rl: POST /init_broadcaster; vLLM: POST /init_weight_transfer_engine; SGLang: POST "
            "/init_weights_update_group), or load a checkpoint from disk (prime-rl: POST /update_weights with "
            "weight_dir)")


def refuse_resume_while_asleep(app: web.Application) -> None:
    if MEMORY in app and app[MEMORY].released:
        raise fleet.Conflict(f"memory is released ({', '.join(sorted(app[MEMORY].released))}): POST /wake_up "
                             "before /resume, or SGLang would run on memory it gave back")


def note_awake(app: web.Application) -> None:
    """A /resume after a level-0 sleep (nothing released) ends the sleep too."""
    if VLLM_RL in app:
        app[VLLM_RL].asleep = False


# --- pause / resume ------------------------------------------------------------------------------

async def pause(request: web.Request) -> web.Response:
    plane = request.app[ADMIN]
    mode = checked_mode(request.query.get("mode", "abort"), VLLM)
    clear_cache = check.query_flag(request.query, "clear_cache", True)
    urls = await plane.worker_urls()
    await pause_fleet(plane, mode, urls)
    if clear_cache and mode in ("abort", "wait"):  # vLLM ignores it with keep (and it is deprecated)
        await flush_or_owe(plane, urls)
    return json_response({"status": "paused"})


async def pause_fleet(plane: AdminPlane, mode: str, urls: list[str]) -> None:
    if mode == "wait":
        await wait_idle(plane, urls, plane.settings.admin_timeout_s, "pause?mode=wait")
    native = to_sglang(mode, VLLM, plane.settings.pause_mode)
    await fleet.pause_workers(plane, native, urls)


async def is_paused(request: web.Request) -> web.Response:
    return json_response({"is_paused": request.app[ADMIN].control.paused})


async def abort_requests(request: web.Request) -> web.Response:
    plane = request.app[ADMIN]
    body = await read_json(request)
    ids = body.get("request_ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids)):
        raise InvalidRequest("request_ids must be a list of request id strings", param="request_ids")
    urls = await plane.worker_urls()
    timeout_s = plane.settings.admin_timeout_s
    if ids:  # a response id stands for its SGLang rids (n samples, several prompts: `<id>-<i>`)
        in_flight = request.app[CONTEXT].in_flight
        rids = [rid for request_id in ids for rid in in_flight.get(request_id, [request_id])]
        count = sum(request_id in in_flight for request_id in ids)
        sent = await asyncio.gather(*(plane.fan_out("POST", "/abort_request", {"rid": rid}, timeout_s, urls)
                                      for rid in rids))
        replies = [r for per_rid in sent for r in per_rid]
    else:
        count = sum(pending(r) or 0 for r in await read_pending(plane, urls, timeout_s))
        replies = await plane.fan_out("POST", "/abort_request", {"abort_all": True}, timeout_s, urls)
    raise_for_failures("abort_requests", replies)
    return json_response({"status": "aborted", "aborted": count})


# --- sleep mode ----------------------------------------------------------------------------------

async def sleep(request: web.Request) -> web.Response:
    """Level 0: pause scheduling only. Level 1: weights to CPU, KV cache dropped. Level 2: drop all."""
    plane, state = request.app[ADMIN], request.app[VLLM_RL]
    level = _int_query(request, "level", 1, 0, 2)
    mode = checked_mode(request.query.get("mode", "abort"), VLLM)
    urls = await plane.worker_urls()
    if level >= 1:
        await _check_can_release(plane, urls, mode, need_cpu_backup=level == 1)
    async with plane.transaction():
        await pause_fleet(plane, mode, urls)
        state.asleep = True
        if level >= 1:
            await wait_idle(plane, urls, plane.settings.admin_timeout_s, "sleep")
            await _release(request, urls, list(SLEEP_TAGS), "sleep")
    return json_response({"status": "sleeping", "level": level})


async def release_kv_cache_memory(request: web.Request) -> web.Response:
    """vLLM: needs a completed pause with no request held, and all memory resident."""
    plane, memory = request.app[ADMIN], request.app[MEMORY]
    urls = await plane.worker_urls()
    if not plane.control.paused:
        raise fleet.Conflict("release_kv_cache_memory() requires a completed pause first")
    if memory.released:
        raise fleet.Conflict("release_kv_cache_memory() requires all executor memory to be resident")
    await _check_can_release(plane, urls, "abort", need_cpu_backup=False)
    loads = await read_pending(plane, urls, fleet.READ_TIMEOUT_S)
    busy = [r.url for r in loads if pending(r) != 0]
    if busy:
        raise fleet.Conflict("release_kv_cache_memory() requires a completed pause first: requests are still "
                             f"held on {', '.join(busy)} (SGLang releases memory only when idle)")
    await _release(request, urls, ["kv_cache"], "release_kv_cache_memory")
    return json_response({"status": "kv_cache_released"})


async def wake_up(request: web.Request) -> web.Response:
    """vLLM reads `tags` as a repeated query parameter (?tags=weights&tags=kv_cache); none wakes everything.
    The named tags still asleep wake; one already awake is skipped (vLLM would skip the whole call). A tag vLLM
    does not know is a 400 here, where vLLM logs a warning and wakes nothing: asleep, every later request
    waiting."""
    plane = request.app[ADMIN]
    tags = request.query.getall("tags", []) or None
    for tag in tags or ():
        if tag not in WAKE_TAGS:
            raise InvalidRequest(f"tags must be among {', '.join(WAKE_TAGS)}, got {tag!r} (SGLang's cuda_graph "
                                 "memory comes back with kv_cache)", param="tags")
    async with plane.transaction():
        return await _wake_up(plane, request.app[VLLM_RL], request.app[MEMORY], tags)


async def _wake_up(plane: AdminPlane, state: VllmRlState, memory: Memory, tags: list[str] | None) -> web.Response:
    # SGLang's resume raises (KeyError, and its scheduler dies) for a tag it has not released: only these.
    back = [native for tag in SLEEP_TAGS if tags is None or tag in tags
            for native in SLEEP_TAGS[tag] if native in memory.released]
    urls = await plane.worker_urls()
    if back:
        await memory_ops.resume(plane, memory, urls, back, "wake_up")
    fully_awake = not memory.released
    if fully_awake and state.asleep:  # a /sleep paused it: resumed once all memory is resident (not a /pause)
        fleet.refuse_resume_while_held(plane, False)
        await fleet.resume_all(plane, urls, "wake_up: resume")
        state.asleep = False
    return json_response({"status": "awake" if fully_awake else "sleeping", "tags": tags})


async def is_sleeping(request: web.Request) -> web.Response:
    state = request.app[VLLM_RL]
    return json_response({"is_sleeping": state.asleep or bool(request.app[MEMORY].released)})


async def _check_can_release(plane: AdminPlane, urls: list[str], mode: str, need_cpu_backup: bool) -> None:
    if mode not in ("abort", "wait"):
        raise NotImplementedBySGLang(
            f"sleep with mode={mode}: SGLang's release_memory_occupation needs an idle scheduler (it asserts), so "
            "it cannot keep requests across a sleep; use mode=abort or mode=wait")
    for url, info in zip(urls, await server_infos(plane, urls)):
        if not info.get("enable_memory_saver"):
            raise NotImplementedBySGLang(
                f"{url} runs without --enable-memory-saver: SGLang's release_memory_occupation would free nothing")
        if need_cpu_backup and not info.get("enable_weights_cpu_backup"):
            raise NotImplementedBySGLang(
                f"sleep level 1 keeps the weights in CPU memory, but {url} runs without "
                "--enable-weights-cpu-backup (SGLang would discard them, which is level 2)")


async def _release(request: web.Request, urls: list[str], tags: list[str], action: str) -> None:
    """Only what is still resident: SGLang would pause a released region again (and stash freed weights), where
    vLLM's executor makes a second sleep a no-op."""
    memory = request.app[MEMORY]
    natives = [native for tag in tags for native in SLEEP_TAGS[tag] if native not in memory.released]
    if natives:
        await memory_ops.release(request.app[ADMIN], memory, request.app[CONTEXT].requests.gate, urls, natives,
                                 action)


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM reads its two flags from the query (a JSON body, as SkyRL sends, is ignored, as in vLLM)."""
    plane = request.app[ADMIN]
    if check.query_flag(request.query, "reset_running_requests", False):
        raise NotImplementedBySGLang("reset_running_requests: SGLang's flush_cache refuses while requests run "
                                     "and cannot reset a running request's cache")
    if check.query_flag(request.query, "reset_external", False):
        raise NotImplementedBySGLang("reset_external: SGLang's flush_cache has no connector-managed cache to reset")
    replies = await flush_or_owe(plane, await plane.worker_urls())
    down = [r for r in replies if r.error is not None]
    if down:
        raise WorkerFailed(failure_status(down), f"reset_prefix_cache failed on {len(down)} of {len(replies)} "
                           "worker(s): " + "; ".join(f"{r.url}: {r.message}" for r in down))
    return json_response({"success": all(r.status == 200 for r in replies)})  # false: owed, flushed once idle


# --- helpers -------------------------------------------------------------------------------------

def _int_query(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    value = request.query.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or not low <= number <= high:
        raise InvalidRequest(f"{name} must be an integer in {low}..{high}, got {value!r}", param=name)
    return number



def add_vllm_rl_state(app: web.Application) -> None:
    """The state vLLM's routes share (their rows are in token_proxy/routes.py; /pause, /resume and
    /update_weights are admin/prime_rl.py's, both dialects)."""
    app[VLLM_RL] = VllmRlState()
    add_memory_state(app)
    add_label_state(app)

