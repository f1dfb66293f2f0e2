"""The rendered-prompt cache on a hit: what a hit costs and what a cached prompt holds, per code tree.

For chat prompts of about 100 to 32,000 ids (the built-in Qwen2 tokenizer), each code tree's
PromptRenderer (in its own process, idle: renders on the loop up to 32 KiB) is timed on a cache hit
(render_chat of a prompt already cached: key, lookup, the caller's list) and on a miss (a distinct
prompt: render, tokenize, store), and the memory one cached prompt keeps is read with tracemalloc. The trees run in turn, `--rounds` times; each row is the round with the best hit median.

    git archive 2d480d5 token_proxy | tar -x -C /tmp/cache-before   # the code before issue 32
    python bench/bench_prompt_cache.py --code /tmp/cache-before --code .
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

SIZES = (100, 1000, 8000, 32000)


def prompt(words: int, salt: str):
    from token_proxy.tokenization.renderer import ChatPrompt

    return ChatPrompt([{"role": "system", "content": "You are a careful assistant."},
                       {"role": "user", "content": f"{salt} " + "the cat sat on the mat. " * (words // 7)}])


async def measure(tokenizer_dir: str, hits: int, repeats: int) -> list[dict]:
    from transformers import AutoTokenizer

    from token_proxy.tokenization.renderer import PromptRenderer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = []
    with ThreadPoolExecutor(1) as pool:
        for size in SIZES:
            renderer = PromptRenderer(tokenizer, pool, 4096, busy=lambda: False)
            chat = prompt(size, "hit")
            ids = len((await renderer.render_chat(chat)).ids)
            samples, misses = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(hits):
                    await renderer.render_chat(chat)
                samples.append((time.perf_counter() - start) / hits)
            for k in range(repeats):
                start = time.perf_counter()
                await renderer.render_chat(prompt(size, f"miss {k}"))
                misses.append(time.perf_counter() - start)
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            await renderer.render_chat(prompt(size, "kept"))  # a miss: rendered, then kept
            await asyncio.sleep(0.05)  # the executor thread lets go of its result
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            rows.append({"ids": ids, "hit_us": statistics.median(samples) * 1e6,
                         "miss_ms": statistics.median(misses) * 1e3, "kept_bytes": kept})
    return rows


def worker(args) -> None:
    rows = asyncio.run(measure(args.tokenizer, args.hits, args.repeats))
    print(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", action="append", help="a tree holding token_proxy/ (repeatable; default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hits", type=int, default=200, help="hits per timed sample")
    p.add_argument("--repeats", type=int, default=15, help="timed samples per prompt size")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from bench_app_cpu import builtin_tokenizer

    tokenizer = builtin_tokenizer()
    codes = [os.path.abspath(c) for c in args.code or [os.path.dirname(here)]]
    best: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for code in codes:
            out = subprocess.run([sys.executable, __file__, "--worker", "--tokenizer", tokenizer, "--hits",
                                  str(args.hits), "--repeats", str(args.repeats)], check=True, capture_output=True,
                                 text=True, env={**os.environ, "PYTHONPATH": code}).stdout
            rows = json.loads(out.strip().splitlines()[-1])
            best[code] = rows if code not in best else [
                min(old, new, key=lambda row: row["hit_us"]) for old, new in zip(best[code], rows)]
    print("| code | prompt ids | hit µs | hit µs per 1k ids | miss ms | bytes kept per cached prompt | bytes per id |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for code in codes:
        for row in best[code]:
            print(f"| {os.path.relpath(code)} | {row['ids']:,} | {row['hit_us']:.1f} | "
                  f"{row['hit_us'] * 1000 / row['ids']:.1f} | {row['miss_ms']:.2f} | {row['kept_bytes']:,} | "
                  f"{row['kept_bytes'] / row['ids']:.1f} |")


if __name__ == "__main__":
    main()
