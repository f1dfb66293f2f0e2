"""The route table's type: a row of routes.py's one table (`Route`), what the middleware reads of a row
(`RouteFlags`), a route's classes (its `kind`) and which serving process answers it with --workers N (its
`answered_by`). It imports nothing of the project: the table's writers (routes.py, serving/control.py) and
its readers (http_io.py's `route_of` / `route_kind`, which ops/ calls) both stand on it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

__all__ = ["ADMIN", "INFERENCE", "LOCAL", "OPS", "OWNER", "TOKENIZER", "Handler", "Route", "RouteFlags"]

INFERENCE, TOKENIZER, ADMIN, OPS = "inference", "tokenizer", "admin", "ops"  # a route's class (`kind`)
# Who answers a row with --workers N: LOCAL, every data-plane process itself; OWNER, the admin owner
# (every other serving process forwards it there over the owner's socket: serving/process_app.py).
LOCAL, OWNER = "local", "owner"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RouteFlags(Protocol):
    """What the middleware reads of a `Route` (through http_io.route_of), so ops/ never imports routes.py."""

    path: str
    kind: str  # INFERENCE (API key + an admission slot) / TOKENIZER (API key) / ADMIN (admin key) / OPS
    quiet: bool  # its access line logs at DEBUG (probes and scrapes)
    served: bool  # the proxy answers it itself (not only listed for its class)
    weight_update: bool  # swaps weights: timed and counted by the metrics
    version_key: str | None  # the key of its body that names the weight version it sets (fleet/plane.py)
    in_openapi: bool  # described by GET /openapi.json
    answered_by: str  # LOCAL: this serving process's own handler (the data plane); OWNER: the admin owner


@dataclass(frozen=True, slots=True)
class Route:
    """One row of the route table (routes.py's ROUTES): registered by routes.add_routes, read per request
    through http_io.route_of as `RouteFlags`."""

    path: str
    methods: tuple[str, ...]
    handler: Handler | None  # None: SGLang answers it (the pass-through); listed for its class and flags
    kind: str  # INFERENCE / TOKENIZER / ADMIN / OPS
    quiet: bool = False  # probes and scrapes would drown the requests that matter: logged at DEBUG
    weight_update: bool = False  # swaps weights: the metrics time and count it, then re-read the version
    # SGLang's calls that set a weight version: the key of their body that names it (the admin plane marks
    # that version incoming while the call runs: fleet/plane.py).
    version_key: str | None = None
    dialect: str | None = None  # None: the proxy's own API; else whose admin API it speaks (routes.py)
    answered_by: str = LOCAL  # LOCAL / OWNER: which serving process answers it under --workers N
    in_openapi: bool = False  # GET /openapi.json describes it (a test holds ops/openapi.py to these rows)

    @property
    def served(self) -> bool:
        """The proxy answers it itself (a row with no handler is only listed)."""
        return self.handler is not None
