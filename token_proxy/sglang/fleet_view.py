"""The one live view of the SGLang fleet behind the backend URL: the worker list as last read and each worker's
facts, whose frozen snapshot (`snapshot()`, an SGLangPicture) is the picture the data path reads.

One writer: the view's own methods. Connecting (sglang/discovery.py) lists the workers and records the picture
it agreed (`learned`); the admin fan-out (sglang/workers.py's `Workers`), and through it the fence's poll and
every admin call, lists them again (`list_workers`). The admin plane reads a worker's facts here (`facts`)
and the last list (`urls`); nobody keeps a copy.

The list is the --worker flags, else what sglang-router lists at GET /workers, else the backend itself. A
worker's facts change only at connect (discovery reads its /model_info, /server_info, /v1/models), so a worker
the router lists later has no facts until then (`facts` is None: its reader asks the worker itself).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from token_proxy.errors import BackendUnavailable
from token_proxy.settings import Settings
from token_proxy.sglang.client import SGLangClient
from token_proxy.sglang.picture import BackendInfo, SGLangPicture
from token_proxy.sglang.replies import router_workers

log = logging.getLogger("token_proxy.fleet.plane")  # the fan-out's line keeps the admin plane's logger

DISCOVERY_TIMEOUT_S = 10.0


@dataclass(slots=True)
class FleetView:
    """The workers behind `client` (the data-path backend, a server or a router) and what connecting learned."""

    settings: Settings
    client: SGLangClient
    # The fan-out's first answer from GET /workers: workers listed (True) or none / no router (False); None:
    # not asked yet, or the ask failed.
    behind_router: bool | None = None
    # The servers the last listing named (the flags, the router's workers, else the backend itself).
    urls: tuple[str, ...] = ()
    picture: SGLangPicture | None = None  # the last connect's: each worker's facts and the agreed ones

    async def list_workers(self, always_ask: bool = False) -> list[str] | None:
        """The servers that generate, read now and recorded: the --worker flags, else the router's listing, else
        the backend itself. None: the router lists no worker yet (recorded as the backend, which a fan-out then
        reaches; connecting waits). A failed call raises its ProxyError and records nothing.

        Whether the backend is a router is the fan-out's verdict, from its first answer (as before the view):
        once it is no router it is not asked again. Connecting (`always_ask`) asks every time and leaves the
        verdict alone, so a fan-out that could not list while SGLang was down asks again (the fence's poll
        relies on it)."""
        if self.settings.workers:
            urls: list[str] | None = [url.rstrip("/") for url in self.settings.workers]
        elif self.behind_router is False and not always_ask:
            urls = [self.client.base_url]
        else:
            listed = await router_listing(self.client)
            if self.behind_router is None and not always_ask:
                self.behind_router = bool(listed)
                if listed:
                    log.info("admin calls fan out to the router's workers: %s", ", ".join(listed))
            urls = None if listed == {} else list(listed or {}) or [self.client.base_url]
        self.urls = tuple(urls or [self.client.base_url])
        return urls

    def learned(self, picture: SGLangPicture) -> None:
        """Connecting agreed this picture (discovery, once the tokenizer it names is loaded)."""
        self.picture = picture

    def snapshot(self) -> SGLangPicture:
        """The frozen picture the data path reads (Connected.picture), or the 503 that says it is not known."""
        if self.picture is None:
            raise BackendUnavailable(f"SGLang at {self.client.base_url} is not discovered yet")
        return self.picture

    def facts(self, url: str) -> BackendInfo | None:
        """What the last connect learned of one worker, or None (not read then: down, or listed since)."""
        return self.picture.workers.get(url.rstrip("/")) if self.picture is not None else None


async def router_listing(client: SGLangClient) -> dict[str, str] | None:
    """sglang-router's workers at GET /workers (url -> id, replies.router_workers), or None when the backend is
    no router (a plain SGLang server answers 404). A call that fails raises its ProxyError."""
    status, raw, _ = await client.call("GET", "/workers", None, DISCOVERY_TIMEOUT_S)
    return router_workers(raw) if status == 200 else None
