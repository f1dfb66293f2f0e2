"""Which part a serving process plays: the one process (single), the admin owner, or a data-plane worker."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

SINGLE, OWNER, WORKER = "single", "owner", "worker"


@dataclass(frozen=True, slots=True)
class Role:
    kind: str = SINGLE
    index: int | None = None  # the worker's number (0 ... N-1), in its access lines
    control_socket: str | None = None  # the owner's Unix socket (workers forward admin routes to it)

    @property
    def multiprocess(self) -> bool:
        return self.kind == WORKER


ROLE = web.AppKey("serving_role", Role)
