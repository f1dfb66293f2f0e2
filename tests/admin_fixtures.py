"""Helpers for the admin-plane tests: simulators in child processes (a torch.distributed group
cannot hold two ranks of one name in one process), free ports, polling."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def sim_process(tokenizer_dir, *args: str):
    """`python -m token_proxy.simulator` on a free port; yields its URL."""
    cmd = [sys.executable, "-m", "token_proxy.simulator", "--port", "0", "--tokenizer", str(tokenizer_dir),
           "--dist-timeout", "10", *args]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("SGLang simulator ready on "), line
        yield line.split(" on ", 1)[1].strip()
    finally:
        stop_process(process)


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
