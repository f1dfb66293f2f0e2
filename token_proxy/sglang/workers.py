"""The SGLang workers behind the proxy, and calls fanned out to all of them at once.

The data path goes to one URL (a server or an sglang-router); weight updates, pauses and LoRA loads must
reach every server. Which servers those are is the fleet's live view (sglang/fleet_view.py: the --worker
flags, else what the router lists at /workers, else the backend itself). The admin plane (fleet/plane.py)
holds this fan-out beside its state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

from token_proxy.errors import BackendTimeout, BackendUnavailable, ProxyError
from token_proxy.settings import Settings
from token_proxy.sglang.client import SGLangClient
from token_proxy.sglang.fleet_view import FleetView
from token_proxy.sglang.replies import message_of, version_text

SERVER_INFO_TIMEOUT_S = 30.0


class WorkerFailed(ProxyError):
    """An admin call failed on one or more workers; the message names each and quotes SGLang."""

    type = "AdminCallFailed"

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class WorkerReply:
    url: str
    status: int  # 0 when the worker could not be reached or did not answer in time
    raw: bytes = b""
    content_type: str = ""
    error: ProxyError | None = None  # unreachable / timed out

    @property
    def body(self):
        if self.content_type == "application/json" or self.raw[:1] in (b"{", b"["):
            try:
                return orjson.loads(self.raw)
            except orjson.JSONDecodeError:
                pass
        return self.raw.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        body = self.body
        return self.error is None and self.status == 200 and not (
            isinstance(body, dict) and body.get("success") is False)

    @property
    def weight_version(self) -> str | None:
        """The weight version a successful reply names (/model_info's), or None."""
        body = self.body if self.ok else None
        return version_text(body.get("weight_version")) if isinstance(body, dict) else None

    @property
    def message(self) -> str:
        """SGLang's own words (replies.message_of), or the text."""
        if self.error is not None:
            return self.error.message
        body = self.body
        text = message_of(body) or (body.strip() if isinstance(body, str) else "")
        return text or f"HTTP {self.status}"


@dataclass
class Workers:
    """One call on every SGLang server behind the backend URL (the admin plane holds it). Which servers those
    are is the fleet's live view (sglang/fleet_view.py): each call lists them there again."""

    settings: Settings
    client: SGLangClient  # the data-path backend (server or router)
    spawn: Callable | None = None  # runs background work that outlives a request (the proxy's spawn)
    # The fleet's live view (the connection's: discovery's Connection.view); a fan-out made alone has its own.
    view: FleetView | None = None
    # Workers a call reaches although the list above omits them (the fence's, taken out of the router's list).
    also_reach: Callable[[], list[str]] = list

    def __post_init__(self) -> None:
        if self.view is None:
            self.view = FleetView(self.settings, self.client)

    @property
    def fleet(self) -> FleetView:
        assert self.view is not None  # set in __post_init__
        return self.view

    @property
    def behind_router(self) -> bool | None:
        """The router answered /workers with workers (True) or the backend is no router (False); None: not known."""
        return self.fleet.behind_router

    @property
    def last_urls(self) -> tuple[str, ...]:
        """The servers the last listing named (for log lines that cannot wait for the router)."""
        return self.fleet.urls

    async def worker_urls(self) -> list[str]:
        try:
            urls = await self.fleet.list_workers() or [self.client.base_url]
        except ProxyError as exc:
            raise WorkerFailed(exc.status, f"cannot list the router's workers: {exc.message}") from exc
        return urls + [url for url in self.also_reach() if url not in urls]

    async def fan_out(self, method: str, path: str, bodies: list[dict] | dict | bytes | None,
                      timeout_s: float, urls: list[str] | None = None) -> list[WorkerReply]:
        """The same call on every worker, concurrently (one body each, or one body for all)."""
        urls = urls if urls is not None else await self.worker_urls()
        if not isinstance(bodies, list):
            bodies = [bodies] * len(urls)
        calls = [self._one(url, method, path, body, timeout_s) for url, body in zip(urls, bodies)]
        return list(await asyncio.gather(*calls))

    async def fan_out_until_failure(self, method: str, path: str, bodies: list[dict] | dict | bytes | None,
                                    timeout_s: float, urls: list[str]) -> list[WorkerReply]:
        """`fan_out`, except that the first worker to fail ends it: the calls still open are cancelled (their
        connections closed) and answered as `aborted`, so one worker's immediate refusal of an NCCL push
        reaches the caller at once instead of after every other worker's timeout."""
        if not isinstance(bodies, list):
            bodies = [bodies] * len(urls)
        tasks = {asyncio.ensure_future(self._one(url, method, path, body, timeout_s)): url
                 for url, body in zip(urls, bodies)}
        done: dict[str, WorkerReply] = {}
        try:
            pending = set(tasks)
            while pending:
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    done[tasks[task]] = task.result()
                failed = [reply for reply in done.values() if not reply.ok]
                if failed and pending:
                    for task in pending:
                        task.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    for task in pending:
                        done[tasks[task]] = aborted(tasks[task], failed[0])
                    break
        finally:
            for task in tasks:
                task.cancel()
        return [done[url] for url in urls]

    async def _one(self, url: str, method: str, path: str, body: dict | bytes | None,
                   timeout_s: float) -> WorkerReply:
        raw = body if body is None or isinstance(body, bytes) else orjson.dumps(body)
        try:
            status, data, content_type = await self.client.at(url).call(method, path, raw, timeout_s)
        except ProxyError as exc:
            return WorkerReply(url, 0, error=exc)
        return WorkerReply(url, status, data, content_type)


class Aborted(ProxyError):
    """A fan-out call the proxy stopped waiting for because another worker had failed first."""

    status = 503


def aborted(url: str, first: WorkerReply) -> WorkerReply:
    return WorkerReply(url, 0, error=Aborted(f"not waited for: {first.url} failed first ({first.message})"))


async def server_infos(plane: Workers, urls: list[str], strict: bool = True) -> list[dict]:
    """Each worker's /server_info (the flags it runs with). One that cannot say is an error naming it
    (503 unreachable, else 502), or with strict=False an empty dict (nothing known about it)."""
    replies = await plane.fan_out("GET", "/server_info", None, SERVER_INFO_TIMEOUT_S, urls)
    out = []
    for reply in replies:
        info = reply.body if reply.ok else None
        if not isinstance(info, dict):
            if strict:
                raise WorkerFailed(503 if reply.error else 502, f"cannot read {reply.url}/server_info: {reply.message}")
            info = {}
        out.append(info)
    return out


def raise_for_failures(action: str, replies: list[WorkerReply]) -> None:
    """Nothing failed, or one error naming every failed worker with SGLang's message.

    Status: 503 if a worker was unreachable (worth a retry), 504 if one timed out, else SGLang's
    own status (400: the request itself was refused; retrying will not help)."""
    failed = [r for r in replies if not r.ok]
    if not failed:
        return
    details = "; ".join(f"{r.url}: {r.message}" for r in failed)
    message = f"{action} failed on {len(failed)} of {len(replies)} worker(s): {details}"
    raise WorkerFailed(failure_status(failed), message)


def failure_status(failed: list[WorkerReply]) -> int:
    if any(isinstance(r.error, BackendUnavailable) for r in failed):
        return 503
    if any(isinstance(r.error, BackendTimeout) for r in failed):
        return 504
    codes = [r.status for r in failed if r.status >= 400]
    if any(code >= 500 for code in codes):
        return 502  # SGLang's own failure, as on the data path
    return codes[0] if codes else 400  # a refusal; {"success": false} can come under a 200


# The fan-out the admin plane holds: what LoRA loads and syncs through.
WORKERS: web.AppKey[Workers] = web.AppKey("sglang_workers", Workers)
