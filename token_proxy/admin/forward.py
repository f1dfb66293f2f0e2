"""SGLang's native admin endpoints (one table, one forwarder) and the pass-through of every other
route, so clients and routers written for SGLang keep working through the proxy."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web
from multidict import CIMultiDict

from token_proxy import checks as check
from token_proxy.admin import labels
from token_proxy.admin import native_checks as native
from token_proxy.errors import InvalidRequest, NotFound
from token_proxy.fleet import transaction as fleet
from token_proxy.fleet import weight_session
from token_proxy.fleet.flush import safe_flush, settle_owed_flushes, settle_refusals
from token_proxy.fleet.plane import ADMIN, AdminPlane, StepResult
from token_proxy.http_io import PASSED_THROUGH, parse_json_object, route_of
from token_proxy.sglang.headers import upstream_headers
from token_proxy.sglang.replies import version_text
from token_proxy.sglang.workers import WorkerFailed, WorkerReply, failure_status, server_infos
from token_proxy.state import CONTEXT

log = logging.getLogger(__name__)

SHORT_TIMEOUT_S = 30.0

Prepare = Callable[[AdminPlane, dict, list[str]], Awaitable[list[dict]]]
After = Callable[[AdminPlane, dict, list[WorkerReply]], None]


@dataclass(frozen=True, slots=True)
class Forward:
    """How one SGLang admin route is forwarded: part of its row in routes.py (methods, class and flags)."""

    timeout: str  # the Settings field bounding the call, or "short"
    fan_out: bool = True  # False: the first worker answers (reads)
    prepare: Prepare | None = None  # validate, and give each worker its body
    after: After | None = None  # the proxy's bookkeeping (weight versions, NCCL steps)
    session: bool = False  # inside SGLang's weight-update session where it is gated (weight_session.py)
    push: bool = False  # one bucket of an NCCL push: the first worker to fail ends it (fleet.push_failed)


async def disk_bodies(plane: AdminPlane, body: dict, urls: list[str]) -> list[dict]:
    check.local_dir(body.get("model_path"), "model_path", plane.settings)
    return await safe_flush(plane, [body] * len(urls), urls)


async def group_bodies(plane: AdminPlane, body: dict, urls: list[str]) -> list[dict]:
    """Validated, and with each worker's own rank_offset when several share one group."""
    check.host(body.get("master_address"), "master_address")
    check.port(body.get("master_port"), "master_port")
    world_size = check.integer(body.get("world_size"), "world_size", 2)
    first = check.integer(body.get("rank_offset"), "rank_offset", 0)  # rank_layout says why not 0
    check.text(body.get("group_name"), "group_name", default="weight_update_group")
    check.backend(body.get("backend", "nccl"))
    offsets = check.rank_layout(first, await tp_sizes(plane, urls), world_size)
    return [{**body, "rank_offset": offset} for offset in offsets]


async def destroy_bodies(plane: AdminPlane, body: dict, urls: list[str]) -> list[dict]:
    """Checked before any worker sees it: the group is named by a string (note_group_gone keys on it)."""
    check.text(body.get("group_name"), "group_name", default="weight_update_group")
    return [body] * len(urls)


async def weight_read_bodies(plane: AdminPlane, body: dict, urls: list[str]) -> list[dict]:
    """SGLang's GetWeightsByNameReqInput: name a string, truncate_size an integer (checked here: no worker
    sees a body it cannot read)."""
    check.text(body.get("name"), "name")
    if body.get("truncate_size") is not None:
        check.integer(body["truncate_size"], "truncate_size", 0)
    return [body] * len(urls)


async def tensor_bodies(plane: AdminPlane, body: dict, urls: list[str]) -> list[dict]:
    check.tensor_specs(body)
    return await safe_flush(plane, [body] * len(urls), urls)


async def version_bodies(plane: AdminPlane, body: dict, urls: list[str]) -> list[dict]:
    """/update_weight_version keeps the requests in flight unless the client asks to abort them: SGLang aborts
    them by default (abort_all_requests: true in every release), vLLM's route of the same name never does,
    and a rollout kept across a keep-pause must not end in an abort (bench/chaos.py's weights_vllm). Refused
    (409) while the last push failed: the label would name weights the workers do not hold (labels.py)."""
    labels.refuse_label_after_failed_push(plane, "update_weight_version")
    return [{"abort_all_requests": False, **body}] * len(urls)


async def tp_sizes(plane: AdminPlane, urls: list[str]) -> list[int]:
    """Ranks per worker (tp_size x pp_size from /server_info; data parallel cannot join a group)."""
    sizes = []
    for url, info in zip(urls, await server_infos(plane, urls)):
        if (info.get("dp_size") or 1) > 1 and not info.get("enable_dp_attention"):
            raise InvalidRequest(f"{url} runs data parallel (dp_size {info['dp_size']}); SGLang cannot "
                                 "join a weight-update group that way")
        sizes.append((info.get("tp_size") or 1) * (info.get("pp_size") or 1))
    return sizes


def note_version(plane: AdminPlane, body: dict, replies: list[WorkerReply]) -> None:
    if all(r.ok for r in replies):
        plane.record_version(version_text(body.get("weight_version")))


def note_new_version(plane: AdminPlane, body: dict, replies: list[WorkerReply]) -> None:
    if all(r.ok for r in replies):
        plane.record_version(version_text(body.get("new_version")))


def note_step(plane: AdminPlane, body: dict, replies: list[WorkerReply]) -> None:
    """A bucket every worker took; the one that carries the weight version ends one NCCL push (a failed
    bucket ends it in fleet.push_failed). A complete push ends a hold: every worker has the new weights."""
    version = version_text(body.get("weight_version"))
    if version is None:
        plane.push.open = True
        return
    plane.push.open = False
    plane.record_version(version)
    plane.weights.loaded_path = None  # the weights came over NCCL: no checkpoint on disk holds them
    if plane.control.hold is not None:
        log.info("a complete NCCL push (version %s) reached every worker: the hold ends", version)
        fleet.set_hold(plane, None)
    plane.push.publish(StepResult(True, "weights received", version))


async def push_bucket(plane: AdminPlane, request: web.Request, path: str, row: Forward, bodies: list[dict],
                      urls: list[str], body: dict) -> web.Response:
    """One bucket of a push through SGLang's own route, to every worker; the first worker to fail ends it
    (the others are cut off), and the fleet goes through fleet.push_failed: groups destroyed, rolled back
    or held. The reply keeps SGLang's failure shape, with the proxy's outcome and each worker's result."""
    def call():
        return plane.fan_out_until_failure(request.method, path, bodies, timeout_of(plane, row.timeout), urls)

    replies = await weight_session.bracketed(plane, urls, call, path)
    replies = await settle_refusals(plane, replies, version_text(body.get("weight_version")))
    if all(r.ok for r in replies):
        note_step(plane, body, replies)
        if labels.UPDATE in request.app:  # every worker took it: a /finish_weight_update may label it
            request.app[labels.UPDATE].start(plane)
        return sglang_reply(path, replies)
    try:
        async with plane.transaction():
            await fleet.push_failed(plane, urls, replies, path)
    except fleet.FleetFailed as exc:
        failed = {"success": False, "message": exc.message, "outcome": exc.outcome,
                  "weight_version": exc.weight_version, "workers": [w.as_dict() for w in exc.workers]}
        return web.Response(status=exc.status, body=orjson.dumps(failed), content_type="application/json")
    raise AssertionError("unreachable: push_failed always raises")


def note_continue(plane: AdminPlane, body: dict, replies: list[WorkerReply]) -> None:
    if all(r.ok for r in replies):
        plane.control.paused = False
        if plane.workers.spawn is not None:
            settle_owed_flushes(plane, plane.workers.spawn)


def note_pause(plane: AdminPlane, body: dict, replies: list[WorkerReply]) -> None:
    if all(r.ok for r in replies):
        plane.mark_paused()


def note_group(plane: AdminPlane, body: dict, replies: list[WorkerReply]) -> None:
    """A group every worker joined: NCCL steps may now arrive (routes.py fails fast without one)."""
    if all(r.ok for r in replies):
        plane.push.live_groups.add(body.get("group_name") or "weight_update_group")


def note_group_gone(plane: AdminPlane, body: dict, replies: list[WorkerReply]) -> None:
    plane.push.live_groups.discard(body.get("group_name") or "weight_update_group")


def note_session_open(plane: AdminPlane, body: dict, replies: list[WorkerReply]) -> None:
    weight_session.note_client_session(plane, weight_session.BEGIN, replies)


def note_session_closed(plane: AdminPlane, body: dict, replies: list[WorkerReply]) -> None:
    weight_session.note_client_session(plane, weight_session.END, replies)


def timeout_of(plane: AdminPlane, name: str) -> float:
    return SHORT_TIMEOUT_S if name == "short" else getattr(plane.settings, name)


def forwarder(path: str, row: Forward):
    """The handler of one SGLang admin route (its row in routes.py's table carries `row`)."""
    async def forward(request: web.Request) -> web.Response:
        plane = request.app[ADMIN]
        raw = await request.read()
        urls = await plane.worker_urls()
        urls = urls if row.fan_out else urls[:1]
        body = _json_object(raw) if row.prepare or row.after else {}
        bodies = await row.prepare(plane, body, urls) if row.prepare else (raw or None)
        if row.push:
            return await push_bucket(plane, request, path, row, bodies, urls, body)
        target = request.path_qs if request.query_string else path
        method = "GET" if request.method == "HEAD" else request.method  # SGLang's routes take no HEAD
        def call():
            return plane.fan_out(method, target, bodies, timeout_of(plane, row.timeout), urls)

        replies = await (weight_session.bracketed(plane, urls, call, path) if row.session else call())
        if row.prepare in (disk_bodies, tensor_bodies):  # SGLang 0.5.22+: updated, flush refused
            replies = await settle_refusals(plane, replies, version_text(body.get("weight_version")))
        if row.after:
            row.after(plane, body, replies)
        reply = sglang_reply(path, replies)
        return web.Response(status=reply.status, headers=reply.headers) if request.method == "HEAD" else reply

    return forward


def sglang_reply(path: str, replies: list[WorkerReply]) -> web.Response:
    """One worker: SGLang's reply unchanged. Several: the first reply when all succeed, else SGLang's
    failure shape naming each worker. A worker that cannot be reached is the proxy's 503/504."""
    if len(replies) == 1 and replies[0].error is None:
        return _as_is(replies[0])
    failed = [r for r in replies if not r.ok]
    if not failed:
        return _as_is(replies[0])
    if len(replies) == 1:
        raise WorkerFailed(replies[0].error.status, f"{path}: {replies[0].message}")
    message = f"{path} failed on {len(failed)} of {len(replies)} workers: " + "; ".join(
        f"{r.url}: {r.message}" for r in failed)
    workers = [{"url": r.url, "status": r.status or None, "success": r.ok, "message": r.message} for r in replies]
    body = {"success": False, "message": message, "workers": workers}
    return web.Response(status=failure_status(failed), body=orjson.dumps(body), content_type="application/json")


def _as_is(reply: WorkerReply) -> web.Response:
    response = web.Response(status=reply.status, body=reply.raw)
    response.content_type = reply.content_type or "application/octet-stream"
    return response


def _json_object(raw: bytes) -> dict:
    return parse_json_object(raw) if raw.strip() else {}


# --- pass-through of routes the proxy does not own ------------------------------------------------

# SGLang's reply headers back to the client: all but the hop-by-hop ones and those aiohttp recomputes. What
# goes upstream is an allow-list (sglang/headers.py): no credential of the client's reaches SGLang.
_DROP = frozenset({"host", "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                   "trailer", "transfer-encoding", "upgrade", "content-length", "accept-encoding",
                   "content-encoding"})


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Method, headers, body and a streamed reply, unchanged, to the backend (server or router).
    A route SGLang does not know either is the proxy's own OpenAI-shaped 404. A native route's body
    that would crash SGLang is refused first, in SGLang's own error shape (native_checks.py)."""
    ctx = request.app[CONTEXT]
    client = ctx.client
    body = await request.read() if request.body_exists else None  # read already by admission (inference)
    if body and native.needs_check(request.path):  # ids and sampling_params that would harm SGLang
        native.check_native(request.path, body, native.Limits(ctx.tokenizer_info.vocab_size,
                                                              ctx.backend.api.sampling_keys))
    method = _upstream_method(request)
    async with ctx.requests.gate.through(), client.open(method, request.path_qs, body or None,
                                                        upstream_headers(request.headers.items())) as upstream:
        if upstream.status == 404:
            raw = await upstream.read()
            if raw.strip() in (b"", b'{"detail":"Not Found"}'):
                raise NotFound(f"The route {request.path} does not exist")
            return web.Response(status=404, body=raw, headers=_kept(upstream.headers))
        if method != request.method:  # HEAD, answered as SGLang's GET without its body
            await upstream.read()
            return web.Response(status=upstream.status, reason=upstream.reason, headers=_kept(upstream.headers))
        response = request[PASSED_THROUGH] = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                                                headers=_kept(upstream.headers))
        await response.prepare(request)
        await _relay(upstream, response)
        row = route_of(request.app, request.path)
        if row is not None and row.weight_update and upstream.status < 300 and ADMIN in request.app:
            request.app[ADMIN].record_version(None)  # /update_weights_from_tensor: its after-hooks run
        return response


def _upstream_method(request: web.Request) -> str:
    row = route_of(request.app, request.path)
    return "GET" if request.method == "HEAD" and row is not None and "GET" in row.methods else request.method


async def _relay(upstream, response: web.StreamResponse) -> None:
    """SGLang's body as it comes; a stream in whole events, so that the drain's error event (ops/drain.py)
    never lands inside one."""
    if response.content_type != "text/event-stream":
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
    else:
        held = b""
        async for chunk in upstream.content.iter_any():
            held += chunk
            end = held.rfind(b"\n\n") + 2
            if end > 1:
                await response.write(held[:end])
                held = held[end:]
        if held:
            await response.write(held)
    await response.write_eof()


def _kept(headers, drop: frozenset = _DROP) -> CIMultiDict:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)


def add_passthrough(app: web.Application) -> None:
    """Last: aiohttp matches routes in the order they were added."""
    app.router.add_route("*", "/{tail:.*}", passthrough)
