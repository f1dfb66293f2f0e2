"""Request ids (the client's, or new ones) and the clock that stamps responses."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from token_proxy.ids import MAX_ID_CHARS


def new_request_id(prefix: str, client_id: str | None) -> str:
    return f"{prefix}-{client_id or uuid.uuid4().hex}"


def header_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id when usable as an SGLang rid and a response header: printable
    (no control characters, no undecodable bytes) and at most MAX_ID_CHARS characters (token_proxy/ids.py)."""
    given = (request.headers.get("X-Request-Id") or "").strip()[:MAX_ID_CHARS]
    return given if given and given.isprintable() else None


def now() -> int:
    return int(time.time())
