"""Access control: an optional API key for inference, a separate admin key for the control plane.

With no admin key configured, admin routes answer only clients on loopback, unless the
operator opens them explicitly. Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from aiohttp import web

from token_proxy.errors import ProxyError
from token_proxy.http_io import route_kind
from token_proxy.route_row import INFERENCE, OPS, TOKENIZER


class Unauthorized(ProxyError):
    status = 401
    type = "AuthenticationError"

    def headers(self) -> dict:
        return {"WWW-Authenticate": "Bearer"}


class Forbidden(ProxyError):
    status = 403
    type = "PermissionDeniedError"


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    api_key: str | tuple[str, ...] | None = None  # several (vllm serve --api-key A B): any of them
    admin_key: str | None = None
    admin_open: bool = False  # with no admin key: let non-loopback clients reach admin routes

    def check(self, path: str, authorization: str | None, remote: str | None, kind: str) -> None:
        """`kind`: the route's class in the route table (routes.py)."""
        if kind == OPS:
            return
        presented = _bearer(authorization)
        if kind in (INFERENCE, TOKENIZER):
            keys = (self.api_key,) if isinstance(self.api_key, str) else self.api_key or ()
            if keys and not any(_same(presented, key) for key in keys) and not _same(presented, self.admin_key):
                raise Unauthorized("A valid API key is required (Authorization: Bearer <key>)")
            return
        if self.admin_key:
            if not _same(presented, self.admin_key):
                raise Unauthorized(f"{path} is an admin route: a valid admin key is required")
        elif not self.admin_open and not _is_loopback(remote):
            raise Forbidden(f"{path} is an admin route and no admin key is configured: it answers only "
                            "on loopback (configure --admin-key, or --admin-open to allow any client)")


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _same(presented: str | None, key: str | None) -> bool:
    if not presented or not key:
        return False
    return hmac.compare_digest(presented.encode(), key.encode())


def _is_loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


ACCESS = web.AppKey("access", AccessPolicy)


@web.middleware
async def access_control(request: web.Request, handler):
    policy = request.app.get(ACCESS)
    if policy is not None:
        policy.check(request.path, request.headers.get("Authorization"), request.remote,
                     route_kind(request.app, request.path))
    return await handler(request)
