"""`python -m token_proxy.cli.healthcheck`: the container's HEALTHCHECK. It asks /health on the port the
proxy was really started with, read from the proxy's own command line and environment (PID 1 in the
image: `docker run IMAGE --port 9000` is checked on 9000, and with --network host never on whatever
else listens on 8000). Exit 0: healthy; 1: not (the reason on stderr)."""

from __future__ import annotations

import ssl
import sys
import urllib.request
from pathlib import Path

from token_proxy.cli.main import parse_settings

WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def proxy_argv_env(pid: int = 1) -> tuple[list[str], dict[str, str]]:
    """The flags and environment the process `pid` was started with (its argv[0] and interpreter dropped)."""
    proc = Path(f"/proc/{pid}")
    argv = [a.decode() for a in proc.joinpath("cmdline").read_bytes().split(b"\0") if a]
    environ = dict(item.decode().partition("=")[::2] for item in proc.joinpath("environ").read_bytes().split(b"\0")
                   if b"=" in item)
    if "-m" in argv:  # python -m token_proxy ...
        argv = argv[argv.index("-m") + 2:]
    while argv and not argv[0].startswith("-"):  # the token-proxy script (and its interpreter)
        argv.pop(0)
    return argv, environ


def health_url(argv: list[str], environ: dict[str, str]) -> str:
    settings = parse_settings(argv, environ)
    host = WILDCARDS.get(settings.host, settings.host)
    host = f"[{host}]" if ":" in host else host
    scheme = "https" if settings.ssl_certfile else "http"
    return f"{scheme}://{host}:{settings.port}/health"


def main(pid: int = 1) -> int:
    url = health_url(*proxy_argv_env(pid))
    # The proxy's own certificate, on loopback: whether it is valid is not this check's question.
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=4, context=context) as resp:
            return 0 if resp.status == 200 else 1
    except OSError as exc:
        sys.stderr.write(f"{url}: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1))
