"""CPU per whole /generate call through `SGLangClient`, as the app builds it, with aiohttp's client options as variants.

A minimal keep-alive HTTP/1.1 server (a subprocess, raw asyncio: it answers every POST with one fixed
SGLang-shaped JSON reply, as uvicorn frames it) stands in for SGLang, so this process's CPU is the client's
alone: `SGLangClient.generate` (its retry point, aiohttp's request, pool and response, `orjson.loads`).
Each round runs every variant once, in turn (interleaved): N sequential calls (c=1), then N calls at c=16;
the figure is `time.process_time` per call, the median over rounds. On uvloop, as the proxy serves.

    python bench/bench_client_call.py --rounds 9 -n 2000
    python bench/bench_client_call.py --code /tmp/before --code .   # the same, per checkout (PYTHONPATH)
    python bench/bench_client_call.py --variants "as built;bare session.post"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

SERVER = r'''
import asyncio, sys
BODY = (b'{"text":" hello","output_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16],"meta_info":{"id":"x",'
        b'"finish_reason":{"type":"length","length":16},"prompt_tokens":200,"completion_tokens":16,'
        b'"cached_tokens":0,"e2e_latency":0.01}}')
HEAD = (b"HTTP/1.1 200 OK\r\ndate: Fri, 27 Nov 2026 11:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-length: %d\r\ncontent-type: application/json\r\n\r\n" % len(BODY))
class P(asyncio.Protocol):
    def connection_made(self, t): self.t, self.buf = t, b""
    def data_received(self, d):
        self.buf += d
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0: return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            n = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None]) if i >= 0 else 0
            if len(self.buf) < end + 4 + n: return
            if len(sys.argv) > 2:
                sys.stdout.write(self.buf[:end].decode() + "\n\n"); sys.stdout.flush()
            self.buf = self.buf[end + 4 + n:]
            self.t.write(HEAD + BODY)
async def main():
    srv = await asyncio.get_running_loop().create_server(P, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    await srv.serve_forever()
asyncio.run(main())
'''

PAYLOAD = {"input_ids": list(range(1000, 1200)), "rid": "bench-0",
           "sampling_params": {"max_new_tokens": 16, "temperature": 1.0}, "stream": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _passthrough(request, handler):
    return await handler(request)


def variants(aiohttp) -> dict:
    """name -> (extra ClientSession options on top of what `sglang_sessions` builds, the call made)."""
    jar = lambda: {"cookie_jar": aiohttp.DummyCookieJar()}  # built inside the running loop
    skip = ("User-Agent", "Accept-Encoding")
    return {
        "as built": (dict, "generate"),
        "+DummyCookieJar": (jar, "generate"),
        "+auto_decompress=False": (lambda: {"auto_decompress": False}, "generate"),
        "+skip UA, Accept-Encoding": (lambda: {"skip_auto_headers": skip}, "generate"),
        "all three": (lambda: {**jar(), "auto_decompress": False, "skip_auto_headers": skip}, "generate"),
        # the layers: aiohttp's bare call (no retry point, no typed errors), then ours added one by one
        "bare session.post": (dict, "bare"),
        # aiohttp 3.12+'s client middlewares (issue 36's model for the retry list): what one no-op costs a call
        "bare, a no-op client middleware": (lambda: {"middlewares": (_passthrough,)}, "bare"),
        "bare, content.read()": (dict, "bare content"),
        "bare, read_bufsize=4096": (dict, "bare bufsize"),
        "bare, a BytesPayload": (dict, "bare payload"),
        "bare, a BytesPayload, no timeout": (dict, "bare payload untimed"),
        "_Call (typed errors)": (dict, "call"),
        "retrying + _Call": (dict, "retrying"),
    }


def make_call(kind: str, url: str, pooled, client, mod):
    """The coroutine function a variant times: one whole /generate and its parsed reply."""
    import aiohttp
    import orjson
    from aiohttp.payload import BytesPayload
    target, headers, timeout = f"{url}/generate", {"Content-Type": "application/json"}, client._timeout

    async def bare(payload):
        async with pooled.post(target, data=orjson.dumps(payload), headers=headers, timeout=timeout,
                               **({"read_bufsize": 4096} if kind == "bare bufsize" else {})) as r:
            return orjson.loads(await (r.content.read() if kind == "bare content" else r.read()))

    async def bare_payload(payload):
        body = BytesPayload(orjson.dumps(payload), content_type="application/json")
        untimed = aiohttp.ClientTimeout(total=None)  # no per-call timer (the proxy needs one: what it costs)
        async with pooled.post(target, data=body, timeout=untimed if kind.endswith("untimed") else timeout) as r:
            return orjson.loads(await r.read())

    async def call(payload):
        async with client._post("/generate", payload, False) as r:
            body = await r.read()
        return orjson.loads(body)

    async def retrying(payload):
        async def once(again):
            async with client._post("/generate", payload, again) as r:
                return await r.read()
        return orjson.loads(await mod.retrying(once, regenerates=True))

    return {"generate": client.generate, "bare payload": bare_payload, "bare payload untimed": bare_payload,
            "call": call,
            "retrying": retrying}.get(kind, bare)


async def run_variant(url: str, extra: dict, kind: str, n: int, conc: int) -> float:
    import aiohttp

    from token_proxy.sglang import client as mod

    try:  # since sglang/pool.py; before, client.py held the pool
        from token_proxy.sglang.pool import ReuseAwareConnector
    except ImportError:
        ReuseAwareConnector = mod.ReuseAwareConnector  # noqa: N806
    pooled = aiohttp.ClientSession(connector=ReuseAwareConnector(limit=0, keepalive_timeout=4.0), **extra)
    fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
    async with pooled, fresh:
        client = mod.SGLangClient(url, pooled, 600.0, 10.0, fresh=fresh)
        call = make_call(kind, url, pooled, client, mod)
        for _ in range(50 if conc == 1 else 3):  # warm: open the pool's connections
            await asyncio.gather(*(call(PAYLOAD) for _ in range(conc)))
        per = n // conc

        async def worker():
            for _ in range(per):
                await call(PAYLOAD)

        t0 = time.process_time()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return (time.process_time() - t0) / (per * conc) * 1e6


async def one_process(url: str, names: list[str], rounds: int, n: int) -> dict[str, list[float]]:
    import aiohttp
    table = variants(aiohttp)
    got: dict[str, list[float]] = {f"{v} c={c}": [] for v in names for c in (1, 16)}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for v in order:
            for c in (1, 16):
                got[f"{v} c={c}"].append(await run_variant(url, table[v][0](), table[v][1], n, c))
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("-n", type=int, default=2000, help="calls per cell")
    ap.add_argument("--variants", default="", help="names separated by ';' (default: all)")
    ap.add_argument("--code", action="append", default=[], help="a checkout to import token_proxy from (repeatable)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # url, variants, out
    a = ap.parse_args()
    if a.child:
        import uvloop
        uvloop.install()
        got = asyncio.run(one_process(a.child[0], a.child[1].split("|"), a.rounds, a.n))
        with open(a.child[2], "w") as f:
            json.dump(got, f)
        return
    import aiohttp
    names = [v for v in variants(aiohttp) if not a.variants or v in a.variants.split(";")]
    if not names:
        ap.error(f"--variants: none of {a.variants!r} is one of {list(variants(aiohttp))}")
    port = free_port()
    srv = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}"
        codes = a.code or ["."]
        results: dict[str, dict[str, list[float]]] = {c: {} for c in codes}
        for r in range(a.rounds):  # interleave checkouts round by round: one child per (round, checkout)
            for code in (codes if r % 2 == 0 else codes[::-1]):
                out = f"/tmp/bench_client_call.{os.getpid()}.json"
                env = {**os.environ, "PYTHONPATH": os.path.abspath(code)}
                subprocess.run([sys.executable, __file__, "--rounds", "1", "-n", str(a.n),
                                "--child", url, "|".join(names), out], env=env, check=True)
                with open(out) as f:
                    for k, v in json.load(f).items():
                        results[code].setdefault(k, []).extend(v)
        print(f"CPU per call, us (median of {a.rounds} interleaved rounds; min..max), {a.n} calls per cell")
        print("| checkout | variant | c=1 | c=16 |")
        print("|---|---|---|---|")
        for code, got in results.items():
            for v in names:
                cells = []
                for c in (1, 16):
                    xs = got[f"{v} c={c}"]
                    cells.append(f"{statistics.median(xs):.1f} ({min(xs):.0f}..{max(xs):.0f})")
                print(f"| {code} | {v} | {cells[0]} | {cells[1]} |")
        if len(codes) == 2:  # paired by round: each round ran both checkouts back to back
            first, second = (results[c] for c in codes)
            for v in names:
                cells = []
                for c in (1, 16):
                    d = [y - x for x, y in zip(first[f"{v} c={c}"], second[f"{v} c={c}"], strict=True)]
                    lower = sum(x < 0 for x in d)
                    cells.append(f"{statistics.median(d):+.1f} ({min(d):+.0f}..{max(d):+.0f}; {lower} of {len(d)} lower)")
                print(f"| {codes[1]} minus {codes[0]}, paired | {v} | {cells[0]} | {cells[1]} |")
    finally:
        srv.terminate()
        srv.wait()


if __name__ == "__main__":
    main()
