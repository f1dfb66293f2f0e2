"""Where a plain chat's proxy time goes: cProfile over the in-process app, N unique chats at c=1.

Starts the simulator (zero latency) as a subprocess, runs the proxy app in this process (one event
loop, served over loopback by aiohttp) and drives it at concurrency 1 with N non-streamed chats,
each with a unique ~200-token prompt (every render a miss; at c=1 the render runs on the loop, so
cProfile sees it) and 16 tokens out. The load generator shares the loop: its own functions are
left out of the stages below (they are aiohttp's client, counted under "aiohttp/asyncio/other"
only where the server shares them, so the per-request total is an upper bound). Prints the
cumulative CPU time (time.process_time) per request of each stage and the top functions by own time:

    python bench/profile_chat.py [--requests 2000] [--out /tmp/chat.prof]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import sys
import time

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_proxy import app_in_process, free_port, start
from bench_vs_smg import OUT_TOKENS, chat_messages

# (stage, (file suffix, function name)): cumulative time of the first match per request.
STAGES = (
    ("http_io.py (body read + JSON decode, route lookups, headers)", ("token_proxy/http_io.py", None)),
    ("parse: parse_chat_request (field readers, messages, tools)", ("api/chat/request.py", "parse_chat_request")),
    ("  of which parse_sampling (api/sampling.py)", ("api/sampling.py", "parse_sampling")),
    ("  of which parse_chat_prompt (api/messages.py)", ("api/messages.py", "parse_chat_prompt")),
    ("render key: ChatPrompt.key_blob + digest", ("tokenization/renderer.py", "key_blob")),
    ("render: apply_chat_template (transformers + jinja2)", ("tokenization/renderer.py", "render_chat_text")),
    ("tokenize: text_encoder's encode (the tiktoken twin on ASCII, else encode_batch_fast)",
     ("tokenization/renderer.py", "encode")),
    ("cache store: _settle (ids -> shared ints)", ("tokenization/renderer.py", "_settle")),
)


def stage_times(stats: pstats.Stats, n: int) -> list[tuple[str, float, int]]:
    rows = []
    for label, (suffix, name) in STAGES:
        total = calls = 0
        for (path, _line, func), (_cc, nc, _tt, ct, _callers) in stats.stats.items():
            if path.endswith(suffix) and (name is None or func == name):
                if name is None and func.startswith("<"):
                    continue
                total += ct
                calls += nc
        rows.append((label, total * 1000 / n, calls))
    return rows


def direct_stages(tokenizer_dir: str, n: int) -> list[tuple[str, float]]:
    """The same stages called directly (no profiler, no server), each over n unique bodies: CPU per call."""
    from transformers import AutoTokenizer
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from token_proxy.api.chat.request import ChatFeatures, ToolFlags, parse_chat_request
    from token_proxy.http_io import parse_json_object
    from token_proxy.tokenization.fast_bpe import build_fast_bpe
    from token_proxy.tokenization.renderer import render_chat_text, text_encoder

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    encode = text_encoder(tok)
    fast, line = build_fast_bpe(tok)
    print(line)
    encode_fast = text_encoder(tok, fast)
    vocab, flags = len(tok), ToolFlags()
    raws = [orjson.dumps({"messages": chat_messages(i), "max_tokens": OUT_TOKENS, "ignore_eos": True,
                          "temperature": 0}) for i in range(n)]
    bodies = [parse_json_object(raw) for raw in raws]
    reqs = [parse_chat_request(body, vocab, flags) for body in bodies]
    texts = [render_chat_text(tok, req.prompt) for req in reqs]
    template = _compile_jinja_template(tok.chat_template)
    specials = dict(tok.special_tokens_map)
    if template.render(messages=reqs[0].prompt.messages, add_generation_prompt=True, tools=None, documents=None,
                       **specials) != texts[0]:
        raise SystemExit("the bare template renders differently from apply_chat_template")
    steps = (
        ("body JSON decode (orjson)", lambda i: parse_json_object(raws[i])),
        ("parse_chat_request", lambda i: parse_chat_request(bodies[i], vocab, flags)),
        ("ChatFeatures.for_request (plain chat: None)", lambda i: ChatFeatures.for_request(reqs[i], bodies[i], {},
                                                                                          flags)),
        ("render_chat_text (apply_chat_template)", lambda i: render_chat_text(tok, reqs[i].prompt)),
        ("  of which the compiled Jinja2 template alone", lambda i: template.render(
            messages=reqs[i].prompt.messages, add_generation_prompt=True, tools=None, documents=None, **specials)),
        ("encode, --fast-encoder false (tokenizers' encode_batch_fast)", lambda i: encode(texts[i], False)),
        ("encode, --fast-encoder true (the tiktoken twin)", lambda i: encode_fast(texts[i], False)),
    )
    if any(encode(text, False) != encode_fast(text, False) for text in texts):
        raise SystemExit("the twin encodes differently from tokenizers")
    rows = []
    for label, step in steps:
        for i in range(min(n, 200)):  # warm
            step(i)
        t0 = time.process_time()
        for i in range(n):
            step(i)
        rows.append((label, (time.process_time() - t0) * 1000 / n))
    return rows


def own_time_by_area(stats: pstats.Stats, n: int) -> list[tuple[str, float]]:
    areas: dict[str, float] = {}
    for (path, _line, func), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
        if "token_proxy/" in path:
            key = "token_proxy/" + path.split("token_proxy/", 1)[1].split("/")[0]
        elif "site-packages/" in path:
            key = path.split("site-packages/", 1)[1].split("/")[0]
        elif path == "~":
            key = "builtins: " + func.split(" of ")[0][:60]
        else:
            key = "stdlib: " + os.path.basename(path)
        areas[key] = areas.get(key, 0.0) + tt
    return sorted(((k, v * 1000 / n) for k, v in areas.items()), key=lambda kv: -kv[1])


async def drive(url: str, n: int, warm: int, profiler: cProfile.Profile) -> float:
    async with aiohttp.ClientSession() as session:
        async def one(salt: int) -> None:
            body = orjson.dumps({"messages": chat_messages(salt), "max_tokens": OUT_TOKENS, "ignore_eos": True,
                                 "temperature": 0})
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                data = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{resp.status} {data[:300]!r}")

        for i in range(warm):
            await one(10**9 + i)
        t0 = time.process_time()
        profiler.enable()
        for i in range(n):
            await one(i)
        profiler.disable()
        return time.process_time() - t0


async def main_async(args, backend: str) -> tuple[cProfile.Profile, float]:
    runner, port = await app_in_process(backend, args.tokenizer)
    # CPU time, not wall time: on a shared box a wall-clock profile charges other processes' turns to
    # whatever was running (a socket send that yields to the simulator, the tokenizer's thread hand-off).
    profiler = cProfile.Profile(time.process_time)
    try:
        cpu = await drive(f"http://127.0.0.1:{port}/v1/chat/completions", args.requests, args.warm, profiler)
    finally:
        await runner.cleanup()
    return profiler, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warm", type=int, default=100)
    parser.add_argument("--out", default=None, help="also write the raw profile here (for snakeviz, pstats)")
    args = parser.parse_args()

    from token_proxy.simulator.builtin_tokenizer import ensure_builtin_tokenizer

    args.tokenizer = str(ensure_builtin_tokenizer())
    port = free_port()
    sim = start([sys.executable, "-m", "token_proxy.simulator", "--port", str(port), "--tokenizer", args.tokenizer,
                 "--ttft-ms", "0", "--tpot-ms", "0", "--log-level", "warning"], f"http://127.0.0.1:{port}")
    try:
        profiler, cpu = asyncio.run(main_async(args, f"http://127.0.0.1:{port}"))
    finally:
        sim.terminate()
    if args.out:
        profiler.dump_stats(args.out)
    print("\n| stage called directly, no profiler (CPU per call) | ms |\n|---|---|")
    for label, ms in direct_stages(args.tokenizer, args.requests):
        print(f"| {label} | {ms:.3f} |")
    stats = pstats.Stats(profiler)
    n = args.requests
    print(f"\n{n} unique non-streamed chats at c=1 (~200-token prompts, {OUT_TOKENS} tokens out), proxy and "
          f"load generator in one process under cProfile: {cpu * 1000 / n:.2f} ms process CPU per request "
          f"(profiled, so inflated)")
    print("\n| stage (cumulative, per request) | ms | calls |\n|---|---|---|")
    for label, ms, calls in stage_times(stats, n):
        print(f"| {label} | {ms:.3f} | {calls} |")
    print("\n| own time by area (per request) | ms |\n|---|---|")
    for area, ms in own_time_by_area(stats, n)[:25]:
        print(f"| {area} | {ms:.3f} |")
    print("\nTop 30 functions by own time:")
    stats.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
