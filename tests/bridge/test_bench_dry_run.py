"""bench/bench_bridge.py --cpu-fallback end to end (issue 38 item 7's script, not its figures): the stand-in
SGLang, the bridge with gloo receivers, the proxies one at a time, the three trainers and the report. A FALLBACK
(gloo, shared memory, the simulator): it proves the GPU call will not fail on a script bug, nothing about NCCL or
SGLang. Needs torch and safetensors (skipped in the proxy's torch-free venv); ~1 min on 2 cores."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_bridge_bench_runs_on_cpu_as_a_labelled_fallback(tmp_path):
    missing = [m for m in ("torch", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the dry run needs {', '.join(missing)}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    vllm_src = os.environ.get("VLLM_SRC", str(ROOT / ".gpu/vllm033"))  # vLLM's packing when present
    out = subprocess.run([sys.executable, "bench/bench_bridge.py", "--cpu-fallback", "--gib", "0.0005", "--rounds",
                          "1", "--packed-bytes", "65536", "--vllm-src", vllm_src, "--logs", str(tmp_path),
                          "--trainer-timeout", "150"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=540, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    raw = json.loads(next(line for line in lines if line.startswith("{")))
    assert list(raw) == ["direct", "broadcast", "bridge"]
    assert {r["tensors"] for r in raw.values()} == {raw["bridge"]["tensors"]} and raw["bridge"]["tensors"] > 0
    assert all(len(r["seconds"]) == 1 for r in raw.values())
    assert lines[lines.index(next(line for line in lines if line.startswith("{"))) + 1].startswith("**FALLBACK")
    assert "Where the bridge's push goes" in out.stdout
    assert "bridge / SGLang's own receiver:" in out.stdout
