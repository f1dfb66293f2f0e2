"""The pipeline's reply check, a hook a feature registers at start-up (fleet/versions.py does, as
lora/resolve.py sets run.py's MODEL_RESOLVER): a reply SGLang made on weights the fleet does not serve is
never returned; it is sent again (a few tries) and counted (token_proxy_stale_replies_total). Which
versions a reply may carry is the hook's to say; the pipeline only asks it and sends again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from token_proxy.errors import BackendUnavailable

log = logging.getLogger(__name__)



class ReplyCheck(Protocol):
    """What the pipeline asks about a reply's weight versions."""

    def current(self) -> str | None: ...  # the fleet's version now (the fast path: a reply carrying it passes)

    async def stale(self, versions: set[str], since: float) -> str | None: ...  # one the fleet did not serve

    def unavailable(self) -> str | None: ...  # why no worker can serve now: a prompt 503, never a wait


def refuse_if_unavailable(check: ReplyCheck | None) -> None:
    """Before a request is sent: with no healthy worker (every one fenced, or the fleet held after a failed
    update) a 503 with Retry-After at once, instead of a wait on a paused worker until the client's timeout."""
    reason = check.unavailable() if check is not None else None
    if reason is not None:
        raise BackendUnavailable(f"no healthy SGLang worker: {reason}")


REPLY_CHECK: web.AppKey[ReplyCheck] = web.AppKey("reply_check", object)


@dataclass(slots=True)
class StaleCheck:
    """What a request carries to the client's one retry point (sglang/retry_rules.py's `VersionCheck`): the
    registered hook's judgement, `tries` sends in all, `count()` per stale reply (the request's stats)."""

    fleet: ReplyCheck
    tries: int
    count: Callable[[], None]

    def fresh(self, versions: set[str]) -> bool:
        """The fast path: every version the reply carries is the fleet's current one (or it carries none)."""
        current = self.fleet.current()
        return all(version == current for version in versions)

    async def stale(self, versions: set[str], since: float) -> str | None:
        bad = await self.fleet.stale(versions, since)
        if bad is None:
            return None
        self.count()
        current = self.fleet.current()
        log.warning("a reply came from weight version %r, not the fleet's %r: sent again (up to %d sends)", bad,
                    current, self.tries)
        return f"SGLang answered from weight version {bad!r} while the fleet serves {current!r}"
