"""TLS on the proxy's own port: vllm serve's --ssl-keyfile, --ssl-certfile and --ssl-ca-certs (a CA bundle
to verify client certificates against; with it a client must present one)."""

from __future__ import annotations

import os
import ssl

from token_proxy.settings import Settings


def server_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """None when no certificate is given; ValueError naming the flag when the files do not make one."""
    if not (settings.ssl_certfile or settings.ssl_keyfile or settings.ssl_ca_certs):
        return None
    if not settings.ssl_certfile:
        raise ValueError("--ssl-keyfile and --ssl-ca-certs need --ssl-certfile (the server's certificate)")
    for flag, path in (("--ssl-certfile", settings.ssl_certfile), ("--ssl-keyfile", settings.ssl_keyfile),
                       ("--ssl-ca-certs", settings.ssl_ca_certs)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r}: no such file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(settings.ssl_certfile, settings.ssl_keyfile)
        if settings.ssl_ca_certs:
            context.load_verify_locations(settings.ssl_ca_certs)
            context.verify_mode = ssl.CERT_REQUIRED
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--ssl-certfile {settings.ssl_certfile!r}: {exc}") from None
    return context


def scheme(settings: Settings) -> str:
    return "https" if settings.ssl_certfile else "http"
