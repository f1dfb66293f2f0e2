"""Side by side on one live SGLang server: its own /v1/chat/completions against the proxy -> /generate.

Same chat prompts (~1,000 tokens, a pool of distinct ones cycled identically on both paths),
128 output tokens with ignore_eos, streaming and not, at each concurrency. SGLang's own
path asks for its token ids where it can (return_token_ids + return_prompt_token_ids when
not streaming; SGLang refuses them when streaming); the proxy path always returns
vLLM's prompt_token_ids and token_ids. Prints one markdown table.

    python bench/bench_vs_sglang.py --sglang http://127.0.0.1:30000 [--concurrency 1 64 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
import urllib.request

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_proxy import free_port, start

MAX_NEW = 128


def prompts(pool: int) -> list[list[dict]]:
    """Distinct ~1,000-token chats (numbers differ, so no two share more than the system prompt)."""
    out = []
    for k in range(pool):
        facts = " ".join(f"Fact {i}: item {k}-{i} weighs {(i * 7919 + k * 104729) % 1000} grams." for i in range(62))
        out.append([{"role": "system", "content": "You are a careful assistant."},
                    {"role": "user", "content": facts + " Which item is heaviest?"}])
    return out


def generate_body(ids: list[int], stream: bool) -> bytes:
    return orjson.dumps({"input_ids": ids, "stream": stream, "sampling_params": {
        "max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}})


def body_for(path: str, messages: list[dict], stream: bool, model: str) -> bytes:
    body = {"model": model, "messages": messages, "max_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0,
            "stream": stream}
    if path == "proxy":
        body["return_token_ids"] = True
    elif not stream:
        body.update(return_token_ids=True, return_prompt_token_ids=True)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


async def one(session, url, body, stream) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.read())[:300]!r}")
        if not stream:
            data = orjson.loads(await resp.read())
            tokens = data["usage"]["completion_tokens"] if "usage" in data else data["meta_info"]["completion_tokens"]
            return time.perf_counter() - t0, time.perf_counter() - t0, tokens
        tokens = 0
        async for line in _sse_lines(resp.content):
            native = line.startswith(b'{"text"')  # SGLang's own /generate events
            if ttft is None and (native or (b'"content":"' in line and b'"role"' not in line)):
                ttft = time.perf_counter() - t0
            if b'"usage":{' in line and b'"choices":[]' in line:
                tokens = orjson.loads(line)["usage"]["completion_tokens"]
            elif native and b'"finish_reason":{' in line:
                tokens = orjson.loads(line)["meta_info"]["completion_tokens"]
    total = time.perf_counter() - t0
    return total, ttft if ttft is not None else total, tokens


async def _sse_lines(content):
    buffer = b""
    async for chunk in content.iter_any():
        buffer += chunk
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: ") and event != b"data: [DONE]":
                yield event[6:]


async def drive(url, path, pool, stream, concurrency, n, model, pool_ids, flush_url) -> dict:
    if path == "generate":
        bodies = [generate_body(ids, stream) for ids in pool_ids]
    else:
        bodies = [body_for(path, p, stream, model) for p in pool]
    latencies, ttfts, tokens, errors = [], [], 0, 0
    counter = iter(range(n))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        for body in bodies[:3]:
            await one(session, url, body, stream)
        # Every path starts from an empty prefix cache, so none profits from the one before.
        async with session.post(flush_url, json={}) as resp:
            await resp.read()

        async def worker():
            nonlocal tokens, errors
            for i in counter:
                try:
                    total, ttft, produced = await one(session, url, bodies[i % len(bodies)], stream)
                    latencies.append(total)
                    ttfts.append(ttft)
                    tokens += produced
                except Exception as exc:  # noqa: BLE001 - counted and shown, never hidden
                    errors += 1
                    print(f"  error: {exc}", file=sys.stderr)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"latencies": sorted(latencies), "ttfts": sorted(ttfts), "tokens": tokens, "wall": wall,
            "errors": errors}


def pct(values, q):
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")


async def prompt_ids(proxy: str, pool: list[list[dict]]) -> list[list[int]]:
    """The very ids the proxy renders, so the raw /generate path sends the same prompts."""
    async with aiohttp.ClientSession() as session:
        out = []
        for messages in pool:
            async with session.post(proxy + "/tokenize", json={"messages": messages}) as resp:
                out.append((await resp.json())["tokens"])
        return out


PATHS = (("SGLang /generate (client-tokenized ids)", "sglang", "generate", "/generate"),
         ("SGLang /v1/chat/completions", "sglang", "sglang", "/v1/chat/completions"),
         ("proxy -> /generate", "proxy", "proxy", "/v1/chat/completions"))


async def run(args, sglang, proxy, model) -> list[tuple]:
    pool = prompts(args.pool)
    pool_ids = await prompt_ids(proxy, pool)
    rows = []
    for stream in (False, True):
        for conc in args.concurrency:
            n = args.single_requests if conc == 1 else max(args.min_requests, conc * args.rounds)
            for label, server, path, route in PATHS:
                url = sglang if server == "sglang" else proxy
                print(f"  {label} stream={stream} c={conc} n={n}", file=sys.stderr)
                r = await drive(url + route, path, pool, stream, conc, n, model, pool_ids, sglang + "/flush_cache")
                rows.append((label, stream, conc, len(r["latencies"]) / r["wall"], r["tokens"] / r["wall"],
                             pct(r["latencies"], 0.5), pct(r["latencies"], 0.99), pct(r["ttfts"], 0.5), r["errors"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sglang", required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--rounds", type=int, default=4, help="requests per concurrency slot")
    parser.add_argument("--min-requests", type=int, default=100)
    parser.add_argument("--pool", type=int, default=64, help="distinct prompts, cycled")
    parser.add_argument("--single-requests", type=int, default=100, help="requests at concurrency 1")
    args = parser.parse_args()
    sglang = args.sglang.rstrip("/")
    with urllib.request.urlopen(sglang + "/server_info", timeout=10) as resp:
        info = json.load(resp)
    port = free_port()
    proxy_url = f"http://127.0.0.1:{port}"
    proxy = start([sys.executable, "-m", "token_proxy", "--backend", sglang, "--host", "127.0.0.1", "--port",
                   str(port), "--log-level", "warning"], proxy_url)
    try:
        with urllib.request.urlopen(proxy_url + "/v1/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]
        rows = asyncio.run(run(args, sglang, proxy_url, model))
    finally:
        proxy.terminate()
    print(f"\n{time.strftime('%Y-%m-%d')}: SGLang {info.get('version')} "
          f"({'incremental' if info.get('incremental_streaming_output') else 'cumulative'} streams), model "
          f"{info.get('model_path')}, ~1,000-token chat prompts ({args.pool} distinct, cycled), {MAX_NEW} output "
          f"tokens (ignore_eos); client, proxy and SGLang on one host ({os.cpu_count()} cores, "
          f"Python {platform.python_version()})")
    print("| path | stream | conc | req/s | output tok/s | p50 ms | p99 ms | TTFT p50 ms | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, stream, conc, rps, tps, p50, p99, ttft, errors in rows:
        print(f"| {label} | {'yes' if stream else 'no'} | {conc} | {rps:.1f} | {tps:.0f} | {p50:.2f} | {p99:.2f} "
              f"| {ttft:.2f} | {errors} |")


if __name__ == "__main__":
    main()
