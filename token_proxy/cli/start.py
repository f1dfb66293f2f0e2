"""The CLI's start-up steps before serving: the port bound (or, for --workers, claimed) so a busy port
fails first in one line, and the built-in simulator started in a child process when there is no --backend.
A problem here is a StartupError: one line, exit status 2."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

from token_proxy.settings import Settings

log = logging.getLogger("token_proxy")  # the CLI's own logger


class StartupError(Exception):
    """A configuration problem found before serving: one line, exit status 2."""


def bind_port(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(1024)
    sock.set_inheritable(False)
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """--workers N: the port claimed but never listened on (this socket gets no connections); a busy
    port fails here, once, before any worker starts. Bound *without* SO_REUSEPORT, so the bind fails
    if anything holds the port, another --workers proxy included; SO_REUSEPORT is set after the bind
    so that this proxy's workers (same user) can join it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(False)
    return sock


@contextlib.contextmanager
def simulator_process(settings: Settings):
    """The built-in simulator on a free loopback port, in a child process so it never shares the
    proxy's event loop."""
    port = _free_port()
    # Configured as the README recommends for SGLang itself: deltas in streams, seeds honoured.
    cmd = [sys.executable, "-m", "token_proxy.simulator", "--host", "127.0.0.1", "--port", str(port),
           "--ttft-ms", str(settings.sim_ttft_ms), "--tpot-ms", str(settings.sim_tpot_ms),
           "--incremental-streaming-output", "--enable-deterministic-inference",
           "--log-level", settings.log_level, "--log-format", settings.log_format,
           "--parent-pid", str(os.getpid())]  # a proxy killed with -9 takes its simulator along (Linux)
    if settings.context_length:
        cmd += ["--context-length", str(settings.context_length)]
    if settings.tokenizer:
        cmd += ["--tokenizer", settings.tokenizer]
    log.warning("no --backend given: starting the built-in SGLang simulator on 127.0.0.1:%d. ITS TOKENS COME FROM "
                "NO MODEL: never train on them (pass --backend http://HOST:30000 for SGLang)", port)
    # The child runs in a session of its own, so a terminal's Ctrl-C (sent to the foreground process group)
    # reaches the proxy alone, which stops the child with SIGTERM, no traceback. (Ignoring SIGINT in the proxy
    # around the fork instead lost a Ctrl-C that landed in that window.)
    proc = None
    try:
        with _ctrl_c_deferred() as interrupted:
            proc = subprocess.Popen(cmd, start_new_session=True)
        if interrupted:
            raise KeyboardInterrupt  # it came while Popen ran: now the child is known, so `finally` stops it
        _wait_for_health(f"http://127.0.0.1:{port}", proc, deadline_s=180.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc is not None:  # None: Popen itself failed, so nothing was started
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def _ctrl_c_deferred():
    """Yields a list that is non-empty if Ctrl-C (SIGINT) came inside the block. A KeyboardInterrupt raised
    inside subprocess.Popen, after its fork, loses the child: Popen never returns it, so nothing stops it, and
    it keeps the proxy's stderr open (a loaded machine widened that window). Signal handlers are the main
    thread's only: elsewhere the block runs as is."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: seen.append(signum))
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait_for_health(url: str, proc: subprocess.Popen, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise StartupError(f"the built-in simulator exited with status {proc.returncode} (see its line above)")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise StartupError(f"the simulator at {url} did not become healthy in {deadline_s:.0f} s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
