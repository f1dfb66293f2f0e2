"""Which part a serving process plays: the one process (single), the admin owner, or one of --workers N data-plane serving processes
(the proxy's own processes; a *worker* is an SGLang server)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

SINGLE, OWNER, SERVING = "single", "owner", "serving"


@dataclass(frozen=True, slots=True)
class Role:
    kind: str = SINGLE
    index: int | None = None  # the serving process's number (0 ... N-1), in its access lines
    control_socket: str | None = None  # the owner's Unix socket (serving processes forward admin routes to it)

    @property
    def multiprocess(self) -> bool:
        return self.kind == SERVING


ROLE = web.AppKey("serving_role", Role)
