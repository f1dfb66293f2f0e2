"""vLLM 0.33's own trainer engine, unmodified, pushing through the proxy (bridge mode) and the bridge on CPU: a
FALLBACK for what the GPU round's engine case runs (bench/bridge_cpu_fallback.py vllm-engine says what is
replaced: vLLM's PyNcclCommunicator by a gloo group on the trainer's own store, CUDA IPC by shared memory, SGLang
by the simulator). What it shows that the GPU round has not yet: vLLM's trainer_init and send_weights (its HTTP
client, its metadata, its packed producer and its unpacked loop) against the proxy's vLLM routes and the bridge's
decoders, with the pushed values landing exactly (read back with /get_weights_by_name), in both transfer modes.
Needs torch, safetensors, requests and vLLM 0.33's imports and files (VLLM_ENGINE_SRC or .gpu/vllm033py[.tar.xz]);
skipped without them (the proxy's venv has no torch)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.bridge.test_upstream_vllm_nccl import NEEDS, vllm_src  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]
FALLBACK = ROOT / "bench/bridge_cpu_fallback.py"


@pytest.fixture(scope="module")
def bench():
    missing = [m for m in ("safetensors", "requests", *NEEDS) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    spec = importlib.util.spec_from_file_location("bench_bridge", ROOT / "bench/bench_bridge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weight(url: str, name: str) -> list:
    req = urllib.request.Request(f"{url}/get_weights_by_name", data=json.dumps({"name": name}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


@pytest.mark.parametrize("packed", [256, 0])
def test_vllms_own_engine_pushes_through_proxy_and_bridge(bench, vllm_src, tmp_path, packed):  # noqa: F811
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = []
    try:
        sglang_port, bridge_port, proxy_port = bench.free_port(), bench.free_port(), bench.free_port()
        sglang = f"http://127.0.0.1:{sglang_port}"
        procs.append(bench.start([sys.executable, str(FALLBACK), "sglang", str(sglang_port),
                                  str(tmp_path / "checkpoint")], str(tmp_path / "sglang.log"), env))
        bench.wait_http(f"{sglang}/health", procs[-1], "the stand-in SGLang")
        procs.append(bench.start([sys.executable, str(FALLBACK), "bridge", "--sglang", sglang, "--port",
                                  str(bridge_port)], str(tmp_path / "bridge.log"), env))
        bench.wait_http(f"http://127.0.0.1:{bridge_port}/bridge/info", procs[-1], "the bridge")
        procs.append(bench.start([sys.executable, "-m", "token_proxy", "--backend", sglang, "--port", str(proxy_port),
                                  "--host", "127.0.0.1", "--weight-bridge", f"http://127.0.0.1:{bridge_port}"],
                                 str(tmp_path / "proxy.log"), env))
        bench.wait_http(f"http://127.0.0.1:{proxy_port}/health", procs[-1], "the proxy")
        before = weight(sglang, "model.norm.weight")
        out = subprocess.run([sys.executable, str(FALLBACK), "vllm-engine", f"http://127.0.0.1:{proxy_port}",
                              str(bench.free_port()), str(tmp_path / "checkpoint"), vllm_src, str(packed), "1"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:] + (tmp_path / "bridge.log").read_text()
        step = json.loads(out.stdout.strip().splitlines()[-1])
        assert step["step"] == 1
        assert weight(sglang, "model.norm.weight") == [v + 0.125 for v in before]
        assert weight(sglang, "model.norm.weight")[:4] == step["sent"]["model.norm.weight"]
        pushes = bench.PUSH_LINE.findall((tmp_path / "bridge.log").read_text())
        assert len(pushes) == 1 and pushes[0][1] == "5", pushes  # one push, the checkpoint's 5 tensors
        # packed: 256-byte buffers cut the 1,424-byte checkpoint into vLLM's chunks (in safetensors' name order:
        # lm_head, embed_tokens, down_proj, then q_proj + norm); unpacked: one bucket
        assert int(pushes[0][0]) == (4 if packed else 1), pushes
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(20)
