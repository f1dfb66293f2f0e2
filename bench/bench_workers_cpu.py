"""CPU per stream by process role, `--workers 1` against `--workers N` (issue 30.3), on a small box.

Starts the simulator (incremental streams, `--tpot-ms` per token so streams last and every event is its own
read) and one proxy per (checkout, worker count), all running throughout; then interleaved rounds (the order
reversed every other round): each round drives every proxy in turn with `--streams` streamed chats of
`--tokens` tokens at `--concurrency`, from a client process of its own. For each point it reads every
process of the measured proxy (bench/proxy_roles.py): on-CPU time, read/write system calls, main-thread
wake-ups, and prints per stream, by role, the median (min..max) over rounds:

    python bench/bench_workers_cpu.py --workers 1 4 --rounds 6          # this checkout
    python bench/bench_workers_cpu.py --code /work/main --code . --workers 1 4   # before / after

`serving`: the process(es) that serve clients (the one process at x1); `supervisor`: the --workers root,
which also runs the admin owner; `reads`/`writes`: system calls per stream of the serving side (128 tokens
are ~130 SGLang events and ~130 SSE writes); `wakeups`: the serving side's main-thread timeslices per stream.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shlex
import signal
import sys
import time
import urllib.request

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import proxy_roles
from bench_proxy import free_port, start

PROMPT_WORDS = 150


def chat_body(k: int, model: str, tokens: int) -> bytes:
    text = " ".join(f"w{(k * 7919 + i) % 997}" for i in range(PROMPT_WORDS))
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": f"{k}: {text}"}],
                         "max_tokens": tokens, "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True}, "return_token_ids": True})


async def drive(url: str, bodies: list[bytes], concurrency: int, read) -> dict:
    """Streams `bodies` to `url`'s chat completions at `concurrency`, each reply handed to `read(resp)` (an async
    callable: what a bench counts per stream); bench_coalesce.py drives its points with it too."""
    done, errors = 0, 0
    todo = iter(bodies)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one_at_a_time():
            nonlocal done, errors
            for body in todo:
                try:
                    async with session.post(url + "/v1/chat/completions", data=body,
                                            headers={"Content-Type": "application/json"}) as resp:
                        if resp.status != 200:
                            raise RuntimeError(f"{resp.status}: {(await resp.read())[:200]!r}")
                        await read(resp)
                    done += 1
                except Exception as exc:  # noqa: BLE001 - counted and shown
                    errors += 1
                    if errors <= 3:
                        print(f"  error: {exc}", file=sys.stderr)

        t0 = time.perf_counter()
        await asyncio.gather(*(one_at_a_time() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"done": done, "errors": errors, "wall": wall}


async def _drive(url: str, bodies: list[bytes], concurrency: int) -> dict:
    events = 0

    async def count(resp) -> None:
        nonlocal events
        async for chunk in resp.content.iter_any():
            events += chunk.count(b"data: ")

    return {**await drive(url, bodies, concurrency, count), "events": events}


def run_point(url: str, root: int, bodies: list[bytes], concurrency: int, driver=None) -> dict:
    """One point: a client process (forked) runs `driver(url, bodies, concurrency)` (default: _drive) while the
    proxy's process tree under `root` is measured per role."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    before = proxy_roles.snapshot(root)
    client = ctx.Process(target=_client_main, args=(driver or _drive, url, bodies, concurrency, out), daemon=True)
    client.start()
    result = out.get()
    client.join()
    after = proxy_roles.snapshot(root)
    roles = proxy_roles.per_role(before, after, result["done"])
    return {**result, "roles": roles, "cells": proxy_roles.role_cells(roles)}


def _client_main(driver, url, bodies, concurrency, out) -> None:
    import uvloop

    out.put(uvloop.run(driver(url, bodies, concurrency)))


def idle_ms_per_s(root: int, seconds: float) -> dict[str, float]:
    """The proxy's background: per second (the per-stream arithmetic with one "stream" a second)."""
    before = proxy_roles.snapshot(root)
    time.sleep(seconds)
    roles = proxy_roles.per_role(before, proxy_roles.snapshot(root), 1)
    return {key: value / seconds for key, value in proxy_roles.role_cells(roles).items() if key != "spread"}


def first_on_path(code: str) -> str:
    return os.pathsep.join(filter(None, [os.path.abspath(code), os.environ.get("PYTHONPATH")]))


def start_proxy(code: str, backend: str, workers: int, flags: list[str]):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "token_proxy", "--backend", backend, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", "--disable-log-requests", *flags]
    if workers != 1:
        cmd += ["--workers", str(workers)]
    # `python -m` puts the working directory first on sys.path, before PYTHONPATH: run in the checkout.
    env_before, cwd_before = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = first_on_path(code)
    os.chdir(code)
    try:
        proc = start(cmd, url)
    finally:
        os.chdir(cwd_before)
        if env_before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env_before
    for _ in range(50):  # every serving process up (the first /health may come from one)
        if len([p for p in proxy_roles.snapshot(proc.pid).values() if p.role == "serving"]) >= (workers if workers > 1 else 0):
            break
        time.sleep(0.2)
    return proc, url


def table(points: dict[str, list[dict]]) -> list[str]:
    columns = proxy_roles.COLUMNS
    lines = ["| proxy | " + " | ".join(label for _, label, _ in columns) + " | streams/s |",
             "|---|" + "---:|" * (len(columns) + 1)]
    for name, runs in points.items():
        cells = [proxy_roles.median_cell([r["cells"][key] for r in runs], digits) for key, _, digits in columns]
        rate = proxy_roles.median_cell([r["done"] / r["wall"] for r in runs], 1)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {rate} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", action="append", default=[], help="a checkout to run the proxy from, optionally "
                        "followed by token-proxy flags (one quoted string); default: this one")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--tpot-ms", type=float, default=20.0)
    parser.add_argument("--scale", action="store_true", help="xN gets N times --concurrency and --streams (the same "
                        "streams per process as x1): tells the cost of a process's load from the cost of N processes")
    parser.add_argument("--idle", type=float, default=0.0, metavar="S",
                        help="first, each proxy's CPU while idle, S seconds each: ms per second by role")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    codes = args.code or ["."]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` or kill: stop the servers too (finally)
    sim_port = free_port()
    backend = f"http://127.0.0.1:{sim_port}"
    sim = start([sys.executable, "-m", "token_proxy.simulator", "--host", "127.0.0.1", "--port", str(sim_port),
                 "--tpot-ms", str(args.tpot_ms), "--incremental-streaming-output"], backend)
    proxies = []
    try:
        for spec in codes:
            code, *flags = shlex.split(spec)
            for workers in args.workers:
                proc, url = start_proxy(code, backend, workers, flags)
                proxies.append((f"{spec} x{workers}", proc, url))
        model = get_json(proxies[0][2] + "/v1/models")["data"][0]["id"]
        serial = iter(range(int(time.time()) % 100_000 * 10_000, 10**12))
        points: dict[str, list[dict]] = {name: [] for name, _, _ in proxies}
        for _name, proc, url in proxies:  # warm-up: connections, caches, lazy imports; not timed
            run_point(url, proc.pid, [chat_body(next(serial), model, args.tokens) for _ in range(8)], 8)
        idle = {name: idle_ms_per_s(proc.pid, args.idle) for name, proc, _ in proxies} if args.idle else {}
        for rnd in range(args.rounds):
            for name, proc, url in (proxies if rnd % 2 == 0 else proxies[::-1]):
                times = int(name.rsplit(" x", 1)[1]) if args.scale else 1
                bodies = [chat_body(next(serial), model, args.tokens) for _ in range(args.streams * times)]
                point = run_point(url, proc.pid, bodies, args.concurrency * times)
                points[name].append(point)
                c = point["cells"]
                print(f"  round {rnd} {name}: {point['done'] / point['wall']:.1f} streams/s, proxy "
                      f"{c['total_ms']:.2f} ms/stream (serving {c['serving_ms']:.2f}, supervisor "
                      f"{c['supervisor_ms']:.3f}), reads {c['reads']:.1f}, writes {c['writes']:.1f}, "
                      f"errors {point['errors']}", file=sys.stderr)
                if args.json_out:
                    with open(args.json_out, "w") as f:
                        f.write(orjson.dumps(points, option=orjson.OPT_INDENT_2).decode())
    finally:
        for _, proc, _ in proxies:
            proc.terminate()
            proc.wait(timeout=60)
        sim.terminate()
    scaled = " (xN: N times as many, at N times the concurrency)" if args.scale else ""
    print(f"\n{args.rounds} interleaved rounds x {args.streams} streams at c={args.concurrency}{scaled}, {args.tokens} tokens "
          f"each (simulator tpot {args.tpot_ms:g} ms); per stream, median (min..max) over rounds; "
          f"{os.cpu_count()} cores")
    print("\n".join(table(points)))
    if idle:
        print(f"\nIdle (no requests, {args.idle:g} s each): CPU ms per second and main-thread wake-ups per second, by role")
        print("| proxy | serving CPU ms/s | supervisor CPU ms/s | serving wake-ups/s | supervisor wake-ups/s |")
        print("|---|---:|---:|---:|---:|")
        for name, cells in idle.items():
            print(f"| {name} | {cells['serving_ms']:.2f} | {cells['supervisor_ms']:.2f} | {cells['wakeups']:.1f} | "
                  f"{cells['supervisor_wakeups']:.1f} |")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return orjson.loads(resp.read())


if __name__ == "__main__":
    main()
