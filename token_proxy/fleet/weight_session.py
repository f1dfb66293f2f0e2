"""SGLang's weight-update session (0.5.21+): every NCCL or tensor update the proxy makes is bracketed.

From 0.5.21 (upstream PR #28001) SGLang's scheduler refuses `/update_weights_from_distributed` and
`/update_weights_from_tensor` with `success: false` ("... must run between begin_weight_update() and
end_weight_update()") unless `POST /begin_weight_update` opened a session first; `POST
/end_weight_update` closes it. A second begin is refused while one is open ("a weight-update session is
already open; call end_weight_update() first"), so a session left open after a failed push would refuse
every later update: the proxy closes what it opened in a `finally`, whatever the push did (refused,
timed out, worker gone). `/update_weights_from_disk` is not gated and is never bracketed.

Which workers need it is their own version (`/server_info` `version`, as the picture of SGLang holds it,
else read then: `SGLangFeatures.weight_update_session`), so a fleet of mixed releases, or a router that reports no
version, is bracketed exactly where SGLang gates. A client that opens the session itself through the
proxy (SGLang's own dialect) keeps it: the proxy's bracket stands aside until the client's
`/end_weight_update`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import orjson

from token_proxy.fleet.plane import AdminPlane
from token_proxy.sglang.versions import SGLangFeatures, features_for
from token_proxy.sglang.workers import WorkerReply, server_infos

log = logging.getLogger(__name__)

BEGIN, END = "/begin_weight_update", "/end_weight_update"
# SGLang's BeginWeightUpdateReqInput / EndWeightUpdateReqInput: a JSON object (FastAPI answers an empty body
# with 422); `selector: "all"` is its default (target and draft runners).
BEGIN_BODY: dict = {}
END_BODY: dict = {}


async def worker_apis(plane: AdminPlane, urls: list[str]) -> list[SGLangFeatures]:
    """Each worker's API generation: the picture's (discovery read its /server_info `version`), else read from
    its /server_info now (a worker the picture lacks; an unreadable one is assumed the newest known, as
    discovery does)."""
    known = {url: info.api for url in urls if (info := plane.facts(url)) is not None}
    missing = [url for url in urls if url not in known]
    if missing:
        for url, info in zip(missing, await server_infos(plane, missing, strict=False)):
            if info:
                known[url] = features_for(info.get("version"))
    return [known.get(url) or features_for(None) for url in urls]


async def gated(plane: AdminPlane, urls: list[str]) -> list[str]:
    """The workers whose next distributed / tensor update must run inside a session the proxy opens."""
    if plane.control.client_session:
        return []
    return [url for url, api in zip(urls, await worker_apis(plane, urls)) if api.weight_update_session]


async def bracketed(plane: AdminPlane, urls: list[str], call: Callable[[], Awaitable[list[WorkerReply]]],
                    action: str) -> list[WorkerReply]:
    """`call()` (an update fanned out to `urls`, one reply each) inside a session on every gated worker.

    A begin refused (or unanswered) anywhere: the update is sent nowhere; that worker's reply is the
    begin's, the others' a refusal saying why. The end always runs on every worker that opened, even
    when the update failed, timed out or the caller left; a worker whose update landed but whose end
    failed gets that failure as its reply (its session may still be open)."""
    need = await gated(plane, urls)
    if not need:
        return await call()
    begins = {r.url: r for r in await plane.fan_out("POST", BEGIN, BEGIN_BODY, plane.settings.admin_timeout_s,
                                                     need)}
    opened = [url for url, reply in begins.items() if reply.ok]
    refused = [reply for reply in begins.values() if not reply.ok]
    ends: dict[str, WorkerReply] = {}
    try:
        if refused:
            why = "; ".join(f"{r.url}: {r.message}" for r in refused)
            replies = [begins[url] if url in begins and not begins[url].ok
                       else _refusal(url, f"{action} not sent: begin_weight_update failed on {why}") for url in urls]
        else:
            replies = await call()
    finally:
        if opened:  # shielded: a caller that leaves must not leave the session open
            ends = {r.url: r for r in await asyncio.shield(_close(plane, opened, action))}
    return [_refusal(r.url, f"{action} landed, but end_weight_update failed: {ends[r.url].message}")
            if r.ok and r.url in ends and not ends[r.url].ok else r for r in replies]


async def _close(plane: AdminPlane, urls: list[str], action: str) -> list[WorkerReply]:
    # The end queues behind an update still running in SGLang (its writer lock): wait as long as for one.
    replies = await plane.fan_out("POST", END, END_BODY, plane.settings.weight_update_timeout_s, urls)
    for reply in replies:
        if not reply.ok:
            log.error("%s: end_weight_update failed on %s: %s (its weight-update session may still be open: "
                      "POST /end_weight_update to close it)", action, reply.url, reply.message)
    return replies


def _refusal(url: str, message: str) -> WorkerReply:
    """A worker's reply in SGLang's refusal shape, for a step the proxy did not (fully) carry out."""
    return WorkerReply(url, 400, orjson.dumps({"success": False, "message": message}), "application/json")


def note_client_session(plane: AdminPlane, path: str, replies: list[WorkerReply]) -> None:
    """A client's own /begin_weight_update or /end_weight_update, forwarded to every worker."""
    if path == BEGIN and all(r.ok for r in replies):
        plane.control.client_session = True
    elif path == END:
        plane.control.client_session = False
