"""Push-time of the weight bridge against SGLang's own receiver, side by side in one run (issue 38, item 7).

SGLang (tiny Qwen2) on its GPU; a trainer process on another GPU pushes the same >= 1 GiB, round after round,
alternately:
- bridge: a vLLM-style trainer (vLLM's packed framing: --vllm-src, else one broadcast per tensor) through a proxy
  in bridge mode and `python -m token_proxy.bridge` (NCCL to the bridge, CUDA IPC into SGLang);
- broadcast: token_proxy.broadcast.SGLangBroadcaster through a plain proxy (SGLang joins the trainer's group and
  receives over NCCL itself: SGLang's own receiver).
The payload is the model's own tensors repeated until --gib is reached (real names, so SGLang loads every copy;
the weights end as they began). Time per push: from the first HTTP call to the last answer. The bridge's log has
its per-push seconds (receive + hand-off); the goal is bridge <= 1.25 x broadcast.

    python bench/bench_bridge.py --sglang http://127.0.0.1:30000 --trainer-gpu 1 --gib 1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, what: str, tries: int = 240) -> None:
    for _ in range(tries):
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"{what} exited ({proc.returncode})") from None
            time.sleep(0.5)
    raise SystemExit(f"{what} did not come up")


def start(args: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


TRAINER = r'''
import json, sys, time, urllib.request, threading, importlib.util, os
import torch
from safetensors.torch import load_file
sys.path.insert(0, os.getcwd())
from tests.e2e.bridge_sender import Communicator, _capture, post
mode, proxy, port, model_dir, gib, rounds, packed = sys.argv[1:8]
torch.cuda.set_device(0)
base = {}
for f in sorted(os.listdir(model_dir)):
    if f.endswith(".safetensors"):
        base.update(load_file(os.path.join(model_dir, f), device="cuda"))
size = sum(t.numel() * t.element_size() for t in base.values())
copies = max(1, int(float(gib) * (1 << 30) // size) + 1)
pairs = [(n, t) for _ in range(copies) for n, t in base.items()]
total = size * copies
times = []
if mode == "broadcast":
    from token_proxy.broadcast import SGLangBroadcaster
    caster = SGLangBroadcaster(url=proxy, master_address="127.0.0.1", master_port=int(port), device="cuda",
                               timeout_s=600, group_name="bench-bridge")
    caster.init()
    for r in range(int(rounds)):
        t0 = time.perf_counter(); caster.update(pairs, version=f"b{r}"); times.append(time.perf_counter() - t0)
    caster.close()
else:
    init = {"init_info": {"master_address": "127.0.0.1", "master_port": int(port), "rank_offset": 1, "world_size": 2,
                          "packed": packed != "0", "packed_buffer_size_bytes": int(packed) or (1 << 30),
                          "packed_num_buffers": 2}}
    call = threading.Thread(target=post, args=(proxy, "/init_weight_transfer_engine", init)); call.start()
    comm = Communicator(int(port), 2, 300); call.join()
    spec = None
    if packed != "0":
        spec = importlib.util.spec_from_file_location("pt", os.environ["VLLM_SRC"] + "/vllm/distributed/weight_transfer/packed_tensor.py")
        pt = importlib.util.module_from_spec(spec); spec.loader.exec_module(pt)
    info = {"names": [n for n, _ in pairs], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs]}
    for r in range(int(rounds)):
        t0 = time.perf_counter()
        post(proxy, "/start_weight_update")
        errors = []
        rpc = threading.Thread(target=_capture, args=(errors, post, proxy, "/update_weights", {"update_info": info}))
        rpc.start()
        if spec is not None:
            pt.packed_nccl_broadcast_producer(iter(pairs), comm, 0, lambda item: item[1], int(packed), 2)
        else:
            for _, t in pairs:
                comm.broadcast(t)
        torch.cuda.synchronize(); rpc.join()
        if errors:
            raise errors[0]
        post(proxy, "/finish_weight_update", {"weight_version": f"g{r}"})
        times.append(time.perf_counter() - t0)
print(json.dumps({"mode": mode, "bytes": total, "tensors": len(pairs), "seconds": times}))
'''


def trainer(mode: str, proxy: str, args, env: dict) -> dict:
    model_dir = json.load(urllib.request.urlopen(f"{args.sglang}/model_info"))["model_path"]
    packed = str(args.packed_bytes) if (mode == "bridge" and env.get("VLLM_SRC")) else "0"
    try:
        out = subprocess.run([sys.executable, "-c", TRAINER, mode, proxy, str(free_port()), model_dir, str(args.gib),
                              str(args.rounds), packed], env=env, capture_output=True, text=True, timeout=180,
                             check=False)
    except subprocess.TimeoutExpired as exc:  # the other path's figures still come out
        print(f"{mode} trainer: no answer within 180 s:\n{(exc.stderr or b'')[-3000:]!r}", file=sys.stderr)
        return {}
    if out.returncode != 0:
        print(f"{mode} trainer failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}", file=sys.stderr)
        return {}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sglang", required=True)
    p.add_argument("--trainer-gpu", default="1")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--packed-bytes", type=int, default=256 << 20, help="vLLM's packed buffer (with --vllm-src)")
    p.add_argument("--vllm-src", default=os.environ.get("VLLM_SRC", ".gpu/vllm033"))
    p.add_argument("--logs", default="/tmp/bench-bridge")
    args = p.parse_args()
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    bridge_port, bridged, plain = free_port(), free_port(), free_port()
    procs = [start([sys.executable, "-m", "token_proxy.bridge", "--sglang", args.sglang, "--port", str(bridge_port)],
                   f"{args.logs}/bridge.log")]
    wait_http(f"http://127.0.0.1:{bridge_port}/bridge/info", procs[0], "the bridge")
    for port, extra in ((bridged, ["--weight-bridge", f"http://127.0.0.1:{bridge_port}"]), (plain, [])):
        procs.append(start([sys.executable, "-m", "token_proxy", "--backend", args.sglang, "--port", str(port),
                            "--host", "127.0.0.1", *extra], f"{args.logs}/proxy-{port}.log"))
        wait_http(f"http://127.0.0.1:{port}/health", procs[-1], "a proxy")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": args.trainer_gpu, "NCCL_NVLS_ENABLE": "0"}
    env.pop("NCCL_CUMEM_ENABLE", None)
    if Path(args.vllm_src, "vllm/distributed/weight_transfer/packed_tensor.py").exists():
        env["VLLM_SRC"] = str(Path(args.vllm_src).resolve())
    try:
        results = {mode: trainer(mode, f"http://127.0.0.1:{port}", args, env)
                   for mode, port in (("broadcast", plain), ("bridge", bridged))}
    finally:
        for proc in procs:
            proc.terminate()
    print(json.dumps(results))  # the raw seconds, whatever happens below
    if all(results.values()):
        print(report(results, args.rounds, Path(args.logs, "bridge.log").read_text()))
    else:
        sys.exit(f"no comparison: {', '.join(m for m, r in results.items() if not r)} failed (its log is above)")


# server.push's log line, one per push: the bridge's own seconds and the part spent waiting for SGLang's loads
PUSH_LINE = re.compile(r"push \(\w+\): (\d+) bucket\(s\), (\d+) tensor\(s\), ([\d.]+) GiB in ([\d.]+) s, "
                       r"of which ([\d.]+) s waiting")


def report(results: dict, rounds: int, bridge_log: str) -> str:
    """The markdown for bench/RESULTS.md: push time per path, the ratio, and where the bridge's push goes."""
    gib = results["bridge"]["bytes"] / (1 << 30)
    med = {mode: statistics.median(r["seconds"]) for mode, r in results.items()}
    names = {"broadcast": "token_proxy.broadcast (SGLang's own NCCL receiver)",
             "bridge": "weight bridge (vLLM sender → bridge → CUDA IPC → SGLang)"}
    lines = [f"| path | GiB | tensors | push s (median of {rounds}) | each | GiB/s | × broadcast |",
             "|---|---|---|---|---|---|---|"]
    for mode, r in results.items():
        lines.append(f"| {names[mode]} | {gib:.2f} | {r['tensors']} | {med[mode]:.3f} | "
                     f"{', '.join(f'{s:.3f}' for s in r['seconds'])} | {gib / med[mode]:.2f} | "
                     f"{med[mode] / med['broadcast']:.2f} |")
    lines.append(f"\nbridge / SGLang's own receiver: {med['bridge'] / med['broadcast']:.2f}x (goal <= 1.25x)")
    pushes = [tuple(map(float, m.groups())) for m in PUSH_LINE.finditer(bridge_log)][-rounds:]
    if len(pushes) == rounds:
        inside = statistics.median(p[3] for p in pushes)
        loads = statistics.median(p[4] for p in pushes)
        lines += ["", f"Where the bridge's push goes (medians; {int(pushes[0][0])} bucket(s) a push):", "",
                  "| part | s | share of the push |", "|---|---|---|",
                  (f"| NCCL receive + IPC hand-off, not waiting on SGLang (bridge) | {inside - loads:.3f} | "
                  f"{(inside - loads) / med['bridge']:.0%} |"),
                  (f"| waiting for SGLang's loads (/update_weights_from_tensor; the next receive overlaps) | "
                  f"{loads:.3f} | {loads / med['bridge']:.0%} |"),
                  (f"| the proxy and HTTP (start/update/finish: session, version, flush) | "
                  f"{med['bridge'] - inside:.3f} | {(med['bridge'] - inside) / med['bridge']:.0%} |")]
    else:
        lines.append(f"\n(the bridge's log has {len(pushes)} push line(s), not {rounds}: no split)")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
