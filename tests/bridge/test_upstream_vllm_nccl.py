"""tests/bridge/upstream.fit_vllm_nccl, the GPU round's way to run vLLM 0.33's own trainer engine on the NCCL the
GPU host has (torch 2.11's 2.28.9), proved on CPU against vLLM's own files (vllm_nccl_probe.py) with a stand-in
libnccl:
- without it, vLLM's NCCLLibrary raises AttributeError for ncclCommSuspend and PyNcclCommunicator turns itself
  off without a word: available False, no id published (what the GPU round saw: the bridge waited 300 s);
- with it, only the two sleep-mode symbols the library lacks are dropped, every symbol the transfer calls stays
  bound, and the communicator publishes its id (which the bridge's allowlisted reader reads back) and goes on
  to ncclCommInitRank;
- a missing symbol other than those two still fails loudly.
Needs torch and vLLM 0.33's imports (pydantic, psutil, pybase64, regex, pyzmq) and its .py files
(VLLM_ENGINE_SRC, or .gpu/vllm033py[.tar.xz]); skipped without them (the proxy's venv has no torch)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDS = ("torch", "pydantic", "psutil", "pybase64", "regex", "zmq")


@pytest.fixture(scope="module")
def vllm_src(tmp_path_factory) -> str:
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"vLLM 0.33's trainer imports need {', '.join(missing)}")
    for candidate in (os.environ.get("VLLM_ENGINE_SRC", ""), str(ROOT / ".gpu/vllm033py")):
        if candidate and Path(candidate, "vllm/distributed/device_communicators/pynccl.py").is_file():
            return candidate
    tarball = ROOT / ".gpu/vllm033py.tar.xz"
    if not tarball.is_file():
        pytest.skip("no vLLM 0.33 .py files: set VLLM_ENGINE_SRC or put .gpu/vllm033py.tar.xz in the checkout")
    out = tmp_path_factory.mktemp("vllm033py")
    with tarfile.open(tarball) as tar:
        tar.extractall(out, filter="data")
    return str(out)


def probe(src: str, absent: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "tests/bridge/vllm_nccl_probe.py", src, absent], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_nccl_2_28_9_turns_vllms_pynccl_off_silently_and_the_filter_brings_it_back(vllm_src):
    out = probe(vllm_src, "ncclCommSuspend,ncclCommResume")
    assert out["library_before"] == "AttributeError: ncclCommSuspend"
    assert out["before"] == {"published_id": [], "available": False, "disabled": True}
    assert out["dropped"] == ["ncclCommSuspend", "ncclCommResume"]
    assert out["library_after"] == "ok"
    assert out["has_suspend"] is False
    assert {"ncclGetUniqueId", "ncclCommInitRank", "ncclAllReduce", "ncclBroadcast", "ncclGetVersion",
            "ncclCommDestroy"} <= set(out["bound"])
    assert out["after"] == {"published_id": ["broadcast_from/0/0"], "reached_comm_init_rank": True,
                            "uid_encoding": "vllm-ctypes", "uid_is_the_librarys": True}


def test_a_library_with_every_symbol_is_left_as_it_is(vllm_src):
    out = probe(vllm_src, "")
    assert out["library_before"] == "ok"
    assert out["dropped"] == []
    assert out["has_suspend"] is True
    assert out["after"]["reached_comm_init_rank"] is True


def test_any_other_missing_symbol_still_fails_loudly(vllm_src):
    out = probe(vllm_src, "ncclCommSuspend,ncclCommResume,ncclBroadcast")
    assert out["dropped"] == ["ncclCommSuspend", "ncclCommResume"]
    assert out["library_after"] == "AttributeError: ncclBroadcast"
