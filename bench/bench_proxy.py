"""What the proxy costs: latency it adds over SGLang's /generate, and throughput against a bare forwarder.

Starts three servers on loopback (the simulator, the proxy in front of it, and a bare
aiohttp pass-through forwarder in front of it), then drives each with the same
~1,000-token chat prompt and 128 output tokens (ignore_eos), streaming and not, at
each concurrency. Prints one table. Usage:

    python bench/bench_proxy.py [--requests 400] [--concurrency 1 64] [--tpot-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_NEW = 128


@dataclass
class Result:
    path: str
    stream: bool
    concurrency: int
    latencies: list[float]
    ttfts: list[float]
    wall: float
    errors: int

    def pct(self, values, q):
        if not values:
            return float("nan")
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] * 1000

    @property
    def rps(self):
        return len(self.latencies) / self.wall


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(cmd: list[str], url: str, env: dict | None = None, cwd: str | None = None) -> subprocess.Popen:
    """Start a server (`env`, `cwd`: its environment and directory, else this one's) and wait for its /health.
    Its output goes to a file: a pipe nobody reads would fill up and stall the server. (`python -m` puts the
    directory before PYTHONPATH: a checkout's proxy starts in that checkout.)"""
    log = tempfile.NamedTemporaryFile(prefix="bench-", suffix=".log", delete=False)  # noqa: SIM115 (the child writes it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    proc.log_path = log.name  # what the server printed (access lines too, at --log-level info)
    end = time.monotonic() + 180
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd} exited: {Path(log.name).read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{cmd} did not start (log: {log.name})")


async def app_in_process(backend: str, tokenizer: str | None):
    """The proxy app in this process (so a profiler sees it) in front of `backend`, connected: its runner
    (`await runner.cleanup()` when done) and port."""
    from aiohttp import web

    from token_proxy.app import create_app
    from token_proxy.settings import Settings
    from token_proxy.sglang.discovery import wait_until_connected

    settings = Settings(backend_url=backend, tokenizer=tokenizer, backend_wait_s=30.0)
    app = create_app(settings)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await wait_until_connected(app, settings.backend_wait_s)
    return runner, port


def chat_prompt() -> list[dict]:
    text = " ".join(f"Fact {i}: the number {i * 7919 % 1000} is interesting." for i in range(80))
    return [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": text + " Summarise."}]


def prompt_ids(tokenizer_dir: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = tok.apply_chat_template(chat_prompt(), add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def bodies(kind: str, ids: list[int], stream: bool) -> tuple[str, bytes]:
    if kind == "chat":
        body = {"model": "bench", "messages": chat_prompt(), "max_tokens": MAX_NEW, "ignore_eos": True,
                "temperature": 0, "stream": stream, "return_token_ids": True}
        return "/v1/chat/completions", orjson.dumps({k: v for k, v in body.items() if k != "model"})
    body = {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}}
    return "/generate", orjson.dumps(body)


async def one(session, url, body, stream) -> tuple[float, float]:
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.read())[:200]!r}")
        if not stream:
            await resp.read()
        else:
            async for _ in resp.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return total, ttft if ttft is not None else total


async def drive(label, base, kind, ids, stream, concurrency, n) -> Result:
    path, body = bodies(kind, ids, stream)
    url = base + path
    lat, ttfts, errors = [], [], 0
    queue = list(range(n))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(min(5, n)):  # warm-up: connections, prompt cache, code paths
            await one(session, url, body, stream)

        async def worker():
            nonlocal errors
            while queue:
                queue.pop()
                try:
                    total, ttft = await one(session, url, body, stream)
                    lat.append(total)
                    ttfts.append(ttft)
                except Exception as exc:  # noqa: BLE001 - counted and shown, not hidden
                    errors += 1
                    print(f"  error on {label}: {exc}", file=sys.stderr)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return Result(label, stream, concurrency, lat, ttfts, wall, errors)


def table(results: list[Result]) -> str:
    head = ("| path | stream | conc | req/s | p50 ms | p99 ms | TTFT p50 ms | added p50 ms | added p99 ms "
            "| vs forwarder req/s | errors |")
    lines = [head, "|" + "---|" * 11]
    direct = {(r.stream, r.concurrency): r for r in results if r.path == "direct /generate"}
    fwd = {(r.stream, r.concurrency): r for r in results if r.path == "bare forwarder"}
    for r in results:
        d = direct[(r.stream, r.concurrency)]
        f = fwd[(r.stream, r.concurrency)]
        added50 = r.pct(r.latencies, 0.5) - d.pct(d.latencies, 0.5)
        added99 = r.pct(r.latencies, 0.99) - d.pct(d.latencies, 0.99)
        lines.append(
            f"| {r.path} | {'yes' if r.stream else 'no'} | {r.concurrency} | {r.rps:.1f} "
            f"| {r.pct(r.latencies, 0.5):.2f} | {r.pct(r.latencies, 0.99):.2f} | {r.pct(r.ttfts, 0.5):.2f} "
            f"| {added50:+.2f} | {added99:+.2f} | {r.rps / f.rps:.2f}x | {r.errors} |")
    return "\n".join(lines)


async def run_all(args, urls, ids) -> list[Result]:
    results = []
    for stream in (False, True):
        for conc in args.concurrency:
            n = args.requests if conc > 1 else max(50, args.requests // 4)
            for label, base, kind in (("direct /generate", urls["sim"], "generate"),
                                      ("bare forwarder", urls["fwd"], "generate"),
                                      ("proxy chat", urls["proxy"], "chat")):
                print(f"  {label} stream={stream} c={conc} n={n}", file=sys.stderr)
                results.append(await drive(label, base, kind, ids, stream, conc, n))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--tpot-ms", type=float, default=0.0)
    parser.add_argument("--incremental", action="store_true", help="simulate --incremental-streaming-output")
    args = parser.parse_args()

    from token_proxy.simulator.builtin_tokenizer import ensure_builtin_tokenizer

    tok_dir = str(ensure_builtin_tokenizer())
    ids = prompt_ids(tok_dir)
    ports = {name: free_port() for name in ("sim", "proxy", "fwd")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    sim_cmd = [sys.executable, "-m", "token_proxy.simulator", "--host", "127.0.0.1", "--port", str(ports["sim"]),
               "--tokenizer", tok_dir, "--ttft-ms", str(args.ttft_ms), "--tpot-ms", str(args.tpot_ms)]
    if args.incremental:
        sim_cmd.append("--incremental-streaming-output")
    procs = [start(sim_cmd, urls["sim"])]
    try:
        procs.append(start([sys.executable, os.path.join(HERE, "forwarder.py"), "--port", str(ports["fwd"]),
                            "--backend", urls["sim"]], urls["fwd"]))
        procs.append(start([sys.executable, "-m", "token_proxy", "--backend", urls["sim"], "--host", "127.0.0.1",
                            "--port", str(ports["proxy"]), "--log-level", "warning"], urls["proxy"]))
        results = asyncio.run(run_all(args, urls, ids))
    finally:
        for proc in procs:
            proc.terminate()
    print(f"\nprompt {len(ids)} tokens, {MAX_NEW} output tokens (ignore_eos), simulator ttft {args.ttft_ms} ms, "
          f"tpot {args.tpot_ms} ms, {'incremental' if args.incremental else 'cumulative'} SGLang streams; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(table(results))


if __name__ == "__main__":
    main()
