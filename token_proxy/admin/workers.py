"""The SGLang workers behind the proxy, and admin calls fanned out to all of them at once.

The data path goes to one URL (a server or an sglang-router); weight updates and pauses must
reach every server. The worker list is the --worker flags, else what the router lists at
/workers, else the backend itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from token_proxy.errors import BackendTimeout, BackendUnavailable, ProxyError
from token_proxy.settings import Settings
from token_proxy.sglang.client import SGLangClient
from token_proxy.sglang.versions import SGLangFeatures

log = logging.getLogger(__name__)

DISCOVERY_TIMEOUT_S = 10.0
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
    def message(self) -> str:
        """SGLang's own words: `message`, `error_message`, `error.message`, `detail`, or the text."""
        if self.error is not None:
            return self.error.message
        body = self.body
        if isinstance(body, dict):
            error = body.get("error")
            text = (body.get("message") or body.get("error_message") or body.get("detail")
                    or (error.get("message") if isinstance(error, dict) else error))
            if text:
                return str(text)
        text = body.strip() if isinstance(body, str) else ""
        return text or f"HTTP {self.status}"


@dataclass(slots=True)
class StepResult:
    """The outcome of one NCCL weight push (its last bucket carries the weight version)."""

    ok: bool
    message: str
    version: str | None
    finished_at: float = field(default_factory=time.monotonic)


@dataclass
class AdminPlane:
    settings: Settings
    client: SGLangClient  # the data-path backend (server or router)
    base_model_path: str | None  # what /reload_weights goes back to
    initial_version: str | None
    version: str | None  # the weight version the proxy last set on every worker
    # The router answered /workers once (True) or not (False); None: not asked yet.
    behind_router: bool | None = None
    paused_at: float = 0.0
    last_step: StepResult | None = None
    _step_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    # The proxy's own record of version changes: (monotonic time, version), oldest first.
    history: list[tuple[float, str]] = field(default_factory=list)
    # Workers that updated weights without flushing their prefix cache (admin_flush.py says why).
    owed_flushes: set[str] = field(default_factory=set)
    spawn: Callable | None = None  # runs background work that outlives a request (the proxy's spawn)
    # Weight-update groups joined through the proxy (an NCCL step without one can never arrive).
    live_groups: set[str] = field(default_factory=set)
    paused: bool = False  # the last pause / continue through the proxy (SGLang cannot be asked)
    # The checkpoint the workers hold now (what a failed fleet update rolls back to).
    loaded_path: str | None = None
    # Each worker's weight version as last read or set (fleet.py); the url -> version.
    worker_versions: dict[str, str | None] = field(default_factory=dict)
    # A failed fleet update the proxy could not undo: the fleet stays paused until it is fixed (fleet.py).
    hold: dict | None = None
    # One weight update at a time (fleet.py): a second waits for the first; /resume meanwhile is a 409.
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    updating: bool = False
    # Each worker's SGLang API generation, read once from its /server_info (weight_session.py).
    worker_api: dict[str, SGLangFeatures] = field(default_factory=dict)
    # A client opened SGLang's weight-update session itself (POST /begin_weight_update through the proxy):
    # the proxy's own bracket stands aside until the client's /end_weight_update.
    client_session: bool = False

    @contextlib.asynccontextmanager
    async def transaction(self):
        """Hold the fleet for one weight update (or sleep / wake-up / group join) from start to end."""
        async with self.update_lock:
            self.updating = True
            try:
                yield
            finally:
                self.updating = False

    async def worker_urls(self) -> list[str]:
        if self.settings.workers:
            return list(self.settings.workers)
        if self.behind_router is not False:
            urls = await self._router_workers()
            if urls:
                return urls
        return [self.client.base_url]

    async def _router_workers(self) -> list[str]:
        """sglang-router lists its workers at GET /workers; a plain SGLang server answers 404."""
        try:
            status, raw, _ = await self.client.call("GET", "/workers", None, DISCOVERY_TIMEOUT_S)
        except ProxyError as exc:
            raise WorkerFailed(exc.status, f"cannot list the router's workers: {exc.message}") from exc
        listed = _listed_urls(raw) if status == 200 else None
        if self.behind_router is None:
            self.behind_router = bool(listed)
            if listed:
                log.info("admin calls fan out to the router's workers: %s", ", ".join(listed))
        return listed or []

    async def fan_out(self, method: str, path: str, bodies: list[dict] | dict | bytes | None,
                      timeout_s: float, urls: list[str] | None = None) -> list[WorkerReply]:
        """The same call on every worker, concurrently (one body each, or one body for all)."""
        urls = urls if urls is not None else await self.worker_urls()
        if not isinstance(bodies, list):
            bodies = [bodies] * len(urls)
        calls = [self._one(url, method, path, body, timeout_s) for url, body in zip(urls, bodies)]
        return list(await asyncio.gather(*calls))

    async def _one(self, url: str, method: str, path: str, body: dict | bytes | None,
                   timeout_s: float) -> WorkerReply:
        raw = body if body is None or isinstance(body, bytes) else orjson.dumps(body)
        try:
            status, data, content_type = await self.client.at(url).call(method, path, raw, timeout_s)
        except ProxyError as exc:
            return WorkerReply(url, 0, error=exc)
        return WorkerReply(url, status, data, content_type)

    def mark_paused(self) -> None:
        """Every worker is paused now (through the proxy)."""
        self.paused_at = time.monotonic()
        self.paused = True

    def record_version(self, version: str | None) -> None:
        if version is not None and version != self.version:
            self.version = version
            self.history.append((time.monotonic(), version))

    def publish_step(self, result: StepResult) -> None:
        self.last_step = result
        self._step_arrived.set()

    async def next_step(self, timeout_s: float) -> StepResult:
        """The first NCCL push that ended after the last /pause (prime-rl pauses, then pushes)."""
        deadline = time.monotonic() + timeout_s
        while self.last_step is None or self.last_step.finished_at < self.paused_at:
            self._step_arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackendTimeout(
                    f"no weight broadcast reached the workers within {timeout_s:g} s: in NCCL mode the "
                    "trainer's broadcaster sends the tensors with /update_weights_from_distributed "
                    "through this proxy (see README, Weight updates)")
            try:
                await asyncio.wait_for(self._step_arrived.wait(), left)
            except asyncio.TimeoutError:
                continue
        return self.last_step


def _listed_urls(raw: bytes) -> list[str] | None:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    workers = data.get("workers") if isinstance(data, dict) else None
    if not isinstance(workers, list):
        return None
    return [w["url"].rstrip("/") for w in workers if isinstance(w, dict) and isinstance(w.get("url"), str)]


async def server_infos(plane: AdminPlane, urls: list[str], strict: bool = True) -> list[dict]:
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

ADMIN: web.AppKey[AdminPlane] = web.AppKey("admin_plane", AdminPlane)
