"""Push-time of the weight bridge against SGLang's own receiver, side by side in one run (issue 38, item 7).

SGLang (tiny Qwen2) on its GPU; a trainer process on another GPU pushes the same >= 1 GiB, round after round,
alternately:
- bridge: a vLLM-style trainer (vLLM's packed framing: --vllm-src, else one broadcast per tensor) through a proxy
  in bridge mode and `python -m token_proxy.bridge` (NCCL to the bridge, CUDA IPC into SGLang);
- broadcast: token_proxy.broadcast.SGLangBroadcaster through a plain proxy (SGLang joins the trainer's group and
  receives over NCCL itself: SGLang's own receiver).
- direct: the same SGLangBroadcaster straight at SGLang, no proxy: SGLang's own receiver alone, the goal's base.
The payload is the model's own tensors repeated until --gib is reached (real names, so SGLang loads every copy;
the weights end as they began). Time per push: from the first HTTP call to the last answer. The bridge's log has
its per-push seconds (receive + hand-off); the goal is bridge <= 1.25 x SGLang's own receiver.

    python bench/bench_bridge.py --sglang http://127.0.0.1:30000 --trainer-gpu 1 --gib 1 --rounds 3

--cpu-fallback runs the same processes and code on CPU with gloo, shared memory and the simulator
(bench/bridge_cpu_fallback.py says what is replaced): a dry run of the script, labelled FALLBACK, whose seconds
are not the bridge's.
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

LABEL = "FALLBACK dry run on CPU: gloo for NCCL, shared memory for CUDA IPC, the simulator for SGLang"


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
from tests.e2e.bridge_sender import _capture, post
mode, proxy, port, model_dir, gib, rounds, packed, device = sys.argv[1:9]
if device == "cuda":
    from tests.e2e.bridge_sender import Communicator
    torch.cuda.set_device(0)
    sync = torch.cuda.synchronize
else:  # the CPU fallback's dry run (bench/bridge_cpu_fallback.py)
    sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
    from bridge_cpu_fallback import GlooCommunicator as Communicator, cpu_packing
    sync = lambda: None
base = {}
for f in sorted(os.listdir(model_dir)):
    if f.endswith(".safetensors"):
        base.update(load_file(os.path.join(model_dir, f), device=device))
size = sum(t.numel() * t.element_size() for t in base.values())
copies = max(1, int(float(gib) * (1 << 30) // size) + 1)
pairs = [(n, t) for _ in range(copies) for n, t in base.items()]
total = size * copies
times = []
if mode in ("broadcast", "direct"):
    from token_proxy.broadcast import SGLangBroadcaster
    caster = SGLangBroadcaster(url=proxy, master_address="127.0.0.1", master_port=int(port),
                               device="cuda" if device == "cuda" else None,
                               backend="nccl" if device == "cuda" else "gloo", timeout_s=600,
                               group_name=f"bench-{mode}")
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
        if device != "cuda":
            cpu_packing(pt)
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
        sync(); rpc.join()
        if errors:
            raise errors[0]
        post(proxy, "/finish_weight_update", {"weight_version": f"g{r}"})
        times.append(time.perf_counter() - t0)
print(json.dumps({"mode": mode, "bytes": total, "tensors": len(pairs), "seconds": times}))
'''


def trainer(mode: str, url: str, args, env: dict) -> dict:
    model_dir = json.load(urllib.request.urlopen(f"{args.sglang}/model_info"))["model_path"]
    packed = str(args.packed_bytes) if (mode == "bridge" and env.get("VLLM_SRC")) else "0"
    device = "cpu" if args.cpu_fallback else "cuda"
    try:
        out = subprocess.run([sys.executable, "-c", TRAINER, mode, url, str(free_port()), model_dir, str(args.gib),
                              str(args.rounds), packed, device], env=env, capture_output=True, text=True,
                             timeout=args.trainer_timeout, check=False)
    except subprocess.TimeoutExpired as exc:  # the other paths' figures still come out
        print(f"{mode} trainer: no answer within {args.trainer_timeout} s:\n{(exc.stderr or b'')[-3000:]!r}",
              file=sys.stderr)
        return {}
    if out.returncode != 0:
        print(f"{mode} trainer failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}", file=sys.stderr)
        return {}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sglang", help="SGLang's URL (with --cpu-fallback: default, a stand-in is started)")
    p.add_argument("--trainer-gpu", default="1")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--packed-bytes", type=int, default=256 << 20, help="vLLM's packed buffer (with --vllm-src)")
    p.add_argument("--vllm-src", default=os.environ.get("VLLM_SRC", ".gpu/vllm033"))
    p.add_argument("--logs", default="/tmp/bench-bridge")
    p.add_argument("--trainer-timeout", type=float, default=180.0, help="seconds for each path's trainer")
    p.add_argument("--cpu-fallback", action="store_true",
                   help="a dry run on CPU: gloo, shared memory, the simulator (bench/bridge_cpu_fallback.py)")
    args = p.parse_args()
    if not args.sglang and not args.cpu_fallback:
        p.error("--sglang is required (or --cpu-fallback, which starts a stand-in)")
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        results = run_paths(args, procs)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps(results))  # the raw seconds, whatever happens below
    if all(results.values()):
        print(report(results, args.rounds, Path(args.logs, "bridge.log").read_text(), args.cpu_fallback))
    else:
        sys.exit(f"no comparison: {', '.join(m for m, r in results.items() if not r)} failed (its log is above)")


FALLBACK = Path(__file__).with_name("bridge_cpu_fallback.py")


def run_paths(args, procs: list[subprocess.Popen]) -> dict:
    """Starts what the paths need (procs, for the caller to stop) and runs each path's trainer in turn. Each proxy
    runs only for its own path: a proxy that sees SGLang's weight version set by another process stops updating
    weights (the fleet's ownership rule), so two proxies side by side would refuse each other's pushes."""
    if args.cpu_fallback and not args.sglang:
        port = free_port()
        procs.append(start([sys.executable, str(FALLBACK), "sglang", str(port), f"{args.logs}/checkpoint"],
                           f"{args.logs}/sglang.log"))
        args.sglang = f"http://127.0.0.1:{port}"
        wait_http(f"{args.sglang}/health", procs[-1], "the stand-in SGLang")
    bridge_port = free_port()
    bridge = [str(FALLBACK), "bridge"] if args.cpu_fallback else ["-m", "token_proxy.bridge"]
    procs.append(start([sys.executable, *bridge, "--sglang", args.sglang, "--port", str(bridge_port)],
                       f"{args.logs}/bridge.log"))
    wait_http(f"http://127.0.0.1:{bridge_port}/bridge/info", procs[-1], "the bridge")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    if not args.cpu_fallback:
        env["CUDA_VISIBLE_DEVICES"] = args.trainer_gpu
    env.pop("NCCL_CUMEM_ENABLE", None)
    if Path(args.vllm_src, "vllm/distributed/weight_transfer/packed_tensor.py").exists():
        env["VLLM_SRC"] = str(Path(args.vllm_src).resolve())
    results = {"direct": trainer("direct", args.sglang, args, env)}
    for mode, extra in (("broadcast", []), ("bridge", ["--weight-bridge", f"http://127.0.0.1:{bridge_port}"])):
        port = free_port()
        proxy = start([sys.executable, "-m", "token_proxy", "--backend", args.sglang, "--port", str(port),
                       "--host", "127.0.0.1", *extra], f"{args.logs}/proxy-{mode}.log")
        procs.append(proxy)
        wait_http(f"http://127.0.0.1:{port}/health", proxy, "a proxy")
        results[mode] = trainer(mode, f"http://127.0.0.1:{port}", args, env)
        proxy.terminate()
        proxy.wait(30)
    return results


# server.push's log line, one per push: the bridge's own seconds and the part spent waiting for SGLang's loads
PUSH_LINE = re.compile(r"push \(\w+\): (\d+) bucket\(s\), (\d+) tensor\(s\), ([\d.]+) GiB in ([\d.]+) s, "
                       r"of which ([\d.]+) s waiting")

NAMES = {"direct": "SGLang's own receiver (token_proxy.broadcast straight at SGLang, no proxy)",
         "broadcast": "token_proxy.broadcast through the proxy (SGLang's own receiver)",
         "bridge": "weight bridge (vLLM sender → proxy + bridge → CUDA IPC → SGLang)"}


def report(results: dict, rounds: int, bridge_log: str, fallback: bool = False) -> str:
    """The markdown for bench/RESULTS.md: push time per path, the ratios, and where the bridge's push goes."""
    gib = results["bridge"]["bytes"] / (1 << 30)
    med = {mode: statistics.median(r["seconds"]) for mode, r in results.items()}
    base = med["direct"]
    lines = [f"**{LABEL}**: these seconds prove the script, not the bridge.", ""] if fallback else []
    lines += [f"| path | GiB | tensors | push s (median of {rounds}) | each | GiB/s | × SGLang's own |",
              "|---|---|---|---|---|---|---|"]
    for mode, r in results.items():
        lines.append(f"| {NAMES[mode]} | {r['bytes'] / (1 << 30):.3f} | {r['tensors']} | {med[mode]:.3f} | "
                     f"{', '.join(f'{s:.3f}' for s in r['seconds'])} | {r['bytes'] / (1 << 30) / med[mode]:.3f} | "
                     f"{med[mode] / base:.2f} |")
    lines.append(f"\nbridge / SGLang's own receiver: {med['bridge'] / base:.2f}x (goal <= 1.25x); bridge / "
                 f"token_proxy.broadcast through the proxy: {med['bridge'] / med['broadcast']:.2f}x")
    pushes = [tuple(map(float, m.groups())) for m in PUSH_LINE.finditer(bridge_log)][-rounds:]
    if len(pushes) == rounds:
        inside = statistics.median(p[3] for p in pushes)
        loads = statistics.median(p[4] for p in pushes)
        rows = [("NCCL receive + IPC hand-off, not waiting on SGLang (bridge)", inside - loads),
                ("waiting for SGLang's loads (/update_weights_from_tensor; the next receive overlaps)", loads),
                ("the proxy and HTTP (start/update/finish: session, version, flush)", med["bridge"] - inside)]
        title = f"Where the bridge's push goes (medians; {int(pushes[0][0])} bucket(s) a push, {gib:.3f} GiB):"
        lines += ["", title, "", "| part | s | share of the push |", "|---|---|---|"]
        lines += [f"| {what} | {s:.3f} | {s / med['bridge']:.0%} |" for what, s in rows]
        lines.append(f"| above SGLang's own receiver (bridge − direct) | {med['bridge'] - base:.3f} | "
                     f"{(med['bridge'] - base) / med['bridge']:.0%} |")
    else:
        lines.append(f"\n(the bridge's log has {len(pushes)} push line(s), not {rounds}: no split)")
    if fallback:
        lines.append(f"\n**{LABEL}.**")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
