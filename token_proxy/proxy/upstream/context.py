"""Re-exports of the connection's shared state (token_proxy.proxy.upstream.connection), for importers
that know it by this name."""

from token_proxy.proxy.upstream.connection import CONTEXT, SETTINGS, BackendInfo, Engine, ProxyContext

__all__ = ["CONTEXT", "SETTINGS", "BackendInfo", "Engine", "ProxyContext"]
