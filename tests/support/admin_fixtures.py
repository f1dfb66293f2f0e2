"""Helpers for tests that start processes (the admin plane's simulators: a torch.distributed group cannot
hold two ranks of one name in one process; a proxy or simulator started as a command): free ports, a
process's HTTP status, polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_status(port: int, path: str) -> int | None:
    """The status a GET of `path` on 127.0.0.1:`port` answers, or None while nothing answers there."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


@contextlib.contextmanager
def sim_process(tokenizer_dir, *args: str):
    """`python -m token_proxy.simulator` on a free port; yields its URL."""
    cmd = [sys.executable, "-m", "token_proxy.simulator", "--port", "0", "--tokenizer", str(tokenizer_dir),
           "--dist-timeout", "10", "--log-format", "json", *args]
    process = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        yield ready_url(process)
    finally:
        stop_process(process)


def ready_url(process: subprocess.Popen) -> str:
    """The URL in the simulator's JSON "ready" log line (its logs go to stderr, one JSON object each)."""
    for line in process.stderr:
        message = json.loads(line)["message"]
        if message.startswith("SGLang simulator ready on "):
            # Keep draining: a full pipe would block the simulator's logging.
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
            return message.split(" on ", 1)[1].strip()
    raise AssertionError(f"the simulator exited ({process.wait()}) without a ready line")


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 10 s."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.005)


def proxy_url(client) -> str:
    return str(client.make_url("")).rstrip("/")


class FakeTensor:
    """What the simulator's receive hands back, without torch (tests/admin/test_broadcast.py receives for real)."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def float(self):
        return self

    def numpy(self):
        return self

    def tobytes(self):
        return repr(self.shape).encode()
