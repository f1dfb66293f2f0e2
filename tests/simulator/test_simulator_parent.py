"""A proxy killed with -9 (`python -m token_proxy` on its built-in simulator) takes its simulator child along:
the child asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG, Linux; --parent-pid), as the
serving processes of --workers N do (serving/process.py). Before, the simulator kept running, its port taken."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.admin_fixtures import free_port, http_status, stop_process

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_proxy_killed_with_sigkill_leaves_no_simulator_running(tokenizer_dir):
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "token_proxy", "--host", "127.0.0.1", "--port", str(port),
                              "--tokenizer", str(tokenizer_dir)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    sims: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while http_status(port, "/health") != 200:
            assert proxy.poll() is None and time.monotonic() < deadline, "the proxy did not become healthy"
            time.sleep(0.3)
        sims = children(proxy.pid)
        assert len(sims) == 1 and "token_proxy.simulator" in Path(f"/proc/{sims[0]}/cmdline").read_text()
        os.kill(proxy.pid, signal.SIGKILL)
        proxy.wait(10)
        gone_by = time.monotonic() + 5
        while alive(sims[0]) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert not alive(sims[0]), "the simulator outlived its proxy"
    finally:
        stop_process(proxy)
        for pid in sims:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_simulator_whose_parent_is_already_gone_exits_at_once(tokenizer_dir):
    sim = subprocess.run([sys.executable, "-m", "token_proxy.simulator", "--port", "0", "--tokenizer",
                          str(tokenizer_dir), "--parent-pid", "1"], check=False, capture_output=True, timeout=60)
    assert sim.returncode == 0
