"""Soak test: many mixed requests at high concurrency through the proxy, some clients walking away.

Starts the simulator and the proxy on loopback, sends --requests requests (streaming and
not, chat and token-in) at --concurrency, lets a share of clients disconnect early, and
reports: outcomes by status, lost or hung requests, 5xx, requests still running in the
simulator at the end, and the proxy's resident memory over time. Bounded in count and
time; stops by itself. Exits non-zero when a request is lost or hung, a 5xx appears, or
the simulator is left with running requests.

    python bench/soak.py [--requests 10000] [--concurrency 256] [--disconnect 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import sys
import time

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_proxy import free_port, start

USER = [{"role": "user", "content": "Write a haiku about token ids."}]
PROMPT_IDS = [151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def request_for(i: int, rng: random.Random) -> tuple[str, dict]:
    stream = rng.random() < 0.5
    max_tokens = rng.randint(8, 64)
    if rng.random() < 0.25:
        return "/inference/v1/generate", {"token_ids": PROMPT_IDS, "stream": stream,
                                          "sampling_params": {"max_tokens": max_tokens, "logprobs": 1}}
    return "/v1/chat/completions", {"messages": USER, "max_tokens": max_tokens, "stream": stream,
                                    "return_token_ids": True, "temperature": 1.0, "seed": i}


async def one(session, base, i, rng, disconnect_share, outcomes, timeout_s):
    path, body = request_for(i, rng)
    leave = rng.random() < disconnect_share
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(base + path, data=orjson.dumps(body)) as resp:
                if leave:  # walk away after the first bytes (or at once for non-streaming)
                    if body.get("stream"):
                        await resp.content.readany()
                    outcomes["disconnected"] += 1
                    return
                raw = await resp.read()
                outcomes[resp.status] += 1
                if resp.status == 200 and body.get("stream") and not raw.endswith(b"data: [DONE]\n\n"):
                    outcomes["stream without [DONE]"] += 1
    except TimeoutError:
        outcomes["hung (timeout)"] += 1
    except aiohttp.ClientError as exc:
        outcomes[f"client error {type(exc).__name__}"] += 1


async def soak(args, base: str, sim: str, proxy_pid: int) -> dict:
    outcomes: collections.Counter = collections.Counter()
    rng = random.Random(args.seed)
    queue = list(range(args.requests))
    memory: list[tuple[float, float]] = []
    t0 = time.monotonic()
    deadline = t0 + args.max_seconds

    async def worker(session):
        while queue and time.monotonic() < deadline:
            i = queue.pop()
            await one(session, base, i, rng, args.disconnect, outcomes, args.request_timeout)

    async def sample_memory():
        while True:
            memory.append((time.monotonic() - t0, rss_mb(proxy_pid)))
            await asyncio.sleep(1.0)

    sampler = asyncio.ensure_future(sample_memory())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
        await asyncio.sleep(1.0)  # let aborts of the last disconnects land
        async with session.get(sim + "/get_load") as resp:
            load = await resp.json()
    sampler.cancel()
    return {"outcomes": outcomes, "memory": memory, "wall": time.monotonic() - t0, "not_sent": len(queue),
            "sim_running": sum(item.get("num_reqs", 0) for item in load)}


def report(args, result) -> int:
    outcomes, memory = result["outcomes"], result["memory"]
    sent = args.requests - result["not_sent"]
    answered = sum(v for k, v in outcomes.items() if isinstance(k, int)) + outcomes["disconnected"]
    lost = sent - answered - outcomes["hung (timeout)"] - sum(
        v for k, v in outcomes.items() if isinstance(k, str) and k.startswith("client error"))
    five_xx = sum(v for k, v in outcomes.items() if isinstance(k, int) and k >= 500)
    warm = [m for t, m in memory if t >= min(10.0, result["wall"] / 3)]
    print(f"requests sent {sent} in {result['wall']:.1f} s ({sent / result['wall']:.0f}/s) at concurrency "
          f"{args.concurrency}, {args.disconnect:.0%} of clients disconnecting")
    print("| outcome | count |\n|---|---|")
    for key, value in sorted(outcomes.items(), key=lambda kv: str(kv[0])):
        print(f"| {key} | {value} |")
    print(f"lost: {lost}; hung: {outcomes['hung (timeout)']}; 5xx: {five_xx}; "
          f"streams without [DONE]: {outcomes['stream without [DONE]']}; "
          f"running in SGLang (simulator) afterwards: {result['sim_running']}")
    if warm:
        print(f"proxy RSS after warm-up: first {warm[0]:.1f} MB, max {max(warm):.1f} MB, last {warm[-1]:.1f} MB "
              f"(growth {warm[-1] - warm[0]:+.1f} MB)")
    bad = lost or outcomes["hung (timeout)"] or five_xx or outcomes["stream without [DONE]"] or result["sim_running"]
    return 1 if bad else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--disconnect", type=float, default=0.05)
    parser.add_argument("--tpot-ms", type=float, default=1.0)
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ports = {name: free_port() for name in ("sim", "proxy")}
    sim = f"http://127.0.0.1:{ports['sim']}"
    base = f"http://127.0.0.1:{ports['proxy']}"
    procs = [start([sys.executable, "-m", "token_proxy.simulator", "--host", "127.0.0.1", "--port",
                    str(ports["sim"]), "--tpot-ms", str(args.tpot_ms), "--incremental-streaming-output",
                    "--enable-deterministic-inference"], sim)]
    try:
        procs.append(start([sys.executable, "-m", "token_proxy", "--backend", sim, "--host", "127.0.0.1",
                            "--port", str(ports["proxy"]), "--log-level", "warning"], base))
        result = asyncio.run(soak(args, base, sim, procs[1].pid))
    finally:
        for proc in procs:
            proc.terminate()
    sys.exit(report(args, result))


if __name__ == "__main__":
    main()
