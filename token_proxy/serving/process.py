"""One data-plane serving process of `--workers N` (a proxy process, not an SGLang worker):
`python -m token_proxy.serving.process RUN_DIR INDEX`, started by the supervisor (supervisor.py) with
PROMETHEUS_MULTIPROC_DIR set. It binds host:port with SO_REUSEPORT beside its siblings and serves until
SIGTERM (then drains, as one process does).

It listens (joins the kernel's SO_REUSEPORT group) at once; a serving process started again after
a death (RESTARTED_ENV set) only once it can serve (SGLang known, its tokenizer loaded): until then the
kernel gives every new connection to the siblings, which serve it, instead of a 503 from this one."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import sys
from pathlib import Path

from token_proxy.role import SERVING, Role

PR_SET_PDEATHSIG = 1
RESTARTED_ENV = "TOKEN_PROXY_PROCESS_RESTARTED"  # set by the supervisor for a serving process started again


def bind_reuse_port(host: str, port: int) -> socket.socket:
    """Bound, not listening: a socket gets connections only once the server on it listens (serve.py)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def _end_with_parent() -> None:
    """Serving processes run in their own session (a terminal's Ctrl-C reaches the supervisor only, which stops
    them in order); if the supervisor dies without doing so, the kernel sends SIGTERM (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:  # the supervisor is already gone
            os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> None:
    run_dir, index = (argv or sys.argv[1:])[:2]
    _end_with_parent()
    settings = pickle.loads((Path(run_dir) / "settings.pickle").read_bytes())
    from token_proxy.ops.access_log import configure_logging
    from token_proxy.serving.serve import exit_at_once, serve

    configure_logging(settings.log_level, settings.log_format, access_lines=not settings.disable_log_requests)
    role = Role(SERVING, index=int(index), control_socket=str(Path(run_dir) / "control.sock"))
    sock = bind_reuse_port(settings.host, settings.port)
    restarted = os.environ.get(RESTARTED_ENV) == "1"
    if not restarted:  # the first start: the port opens at once and answers 503 until SGLang is connected
        sock.listen(1024)
    serve(settings, sock, role=role, listen_when_ready=restarted)
    exit_at_once(0)


if __name__ == "__main__":
    main()
