"""Side by side with SMG 1.13 (SGLang's Rust gateway) in gRPC mode: front CPU, c=1 latency, c=64 throughput.

Starts, on loopback, the proxy in front of its simulator (zero latency) and SMG in gRPC mode in
front of a zero-latency stand-in of SGLang's gRPC scheduler (bench/smg_standin.py), then drives
each front in interleaved rounds with unique ~200-token prompts and 16 output tokens (ignore_eos):
chat (/v1/chat/completions) and token-in (the proxy's /inference/v1/generate, SMG's /generate),
streamed and not. Both load the project's offline test tokenizer (SMG gets a copy with a
config.json: without one it looks the model up on the hub per request and stalls offline).
Prints, per front and path, the medians over rounds of: front CPU per request (the front
process's CPU time from /proc/PID/stat over the cell, divided by its requests), c=1 p50, c=64 req/s.

SMG needs its own venv (the proxy's venv is untouched):

    python3 -m venv /tmp/venv-smg && /tmp/venv-smg/bin/pip install 'smg==1.13.*' smg-grpc-proto grpcio-tools
    python bench/bench_vs_smg.py [--smg-python /tmp/venv-smg/bin/python] [--rounds 8] [--n1 80] [--n64 300]
    python bench/bench_vs_smg.py --code /tmp/base --code . --workers 1 2   # before/after, x1 and x2, one run
    python bench/bench_vs_smg.py --code /tmp/base:1 --code .:1,2            # before at x1; after at x1 and x2

With several `--code` checkouts and `--workers` counts, one proxy runs per (checkout, count), all in front of
the same simulator, and every round drives each front in turn (the order reversed every other round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_proxy import free_port, start
from cpu_groups import descendants

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_TOKENS = 16
CLK_TCK = os.sysconf("SC_CLK_TCK")
PATHS = (("chat", False), ("chat", True), ("token-in", False), ("token-in", True))
# What the config.json of the stand-in's tokenizer folder says (the built-in Qwen2 layout).
MODEL_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
                "bos_token_id": 151643, "eos_token_id": 151645, "max_position_embeddings": 32768}


def proc_cpu_s(pid: int) -> float:
    """utime + stime (+ reaped children's) of `pid` and its live descendants (/proc/PID/stat, clock ticks)."""
    total = 0
    for each in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{each}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(v) for v in fields[11:15])
    return total / CLK_TCK


def prompt_text(salt: int) -> str:
    """~200 tokens, unique per salt (so no render or prefix cache ever hits)."""
    facts = " ".join(f"Fact {i}: item {salt}-{i} weighs {(salt * 31 + i * 7919) % 1000} grams." for i in range(11))
    return f"Request {salt}. {facts} Summarise."


def chat_messages(salt: int) -> list[dict]:
    return [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": prompt_text(salt)}]


@dataclass
class Front:
    name: str
    url: str
    pid: int
    chat_path: str
    token_path: str

    @property
    def is_smg(self) -> bool:
        return self.name == "smg"

    def body(self, kind: str, stream: bool, salt: int, ids: list[int]) -> tuple[str, bytes]:
        if kind == "chat":
            body = {"model": "bench", "messages": chat_messages(salt), "max_tokens": OUT_TOKENS,
                    "ignore_eos": True, "temperature": 0, "stream": stream}
            if not self.is_smg:
                del body["model"]
            return self.chat_path, orjson.dumps(body)
        params = {"max_new_tokens" if self.is_smg else "max_tokens": OUT_TOKENS,
                  "ignore_eos": True, "temperature": 0}
        if self.is_smg:
            body = {"model": "bench", "input_ids": ids, "stream": stream, "sampling_params": params}
        else:
            body = {"token_ids": ids, "stream": stream, "sampling_params": params}
        return self.token_path, orjson.dumps(body)


@dataclass
class Cell:
    cpu_ms: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)


async def one(session, url: str, body: bytes, stream: bool) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        data = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {data[:300]!r}")
        if stream and b"[DONE]" not in data and data.count(b"data:") < OUT_TOKENS:
            raise RuntimeError(f"{url}: short stream {data[-300:]!r}")
    return time.perf_counter() - t0


async def drive(session, url: str, bodies: list[bytes], stream: bool, concurrency: int) -> tuple[list[float], float]:
    queue = list(reversed(bodies))
    latencies: list[float] = []

    async def worker():
        while queue:
            latencies.append(await one(session, url, queue.pop(), stream))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - t0


async def run_rounds(args, fronts: list[Front], token_ids) -> dict:
    cells = {(f.name, kind, stream): Cell() for f in fronts for kind, stream in PATHS}
    salt = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        for f in fronts:  # warm-up: connections, code paths, the tokenizer's first calls
            for kind, stream in PATHS:
                path, body = f.body(kind, stream, 10**9, token_ids(10**9))
                for _ in range(20):
                    await one(session, f.url + path, body, stream)
        for rnd in range(args.rounds):
            order = fronts if rnd % 2 == 0 else fronts[::-1]
            for kind, stream in PATHS:
                for f in order:
                    n = args.n1 + args.n64
                    path, _ = f.body(kind, stream, 0, [])
                    bodies = [f.body(kind, stream, salt + i, token_ids(salt + i))[1] for i in range(n)]
                    salt += n
                    cpu0 = proc_cpu_s(f.pid)
                    lat1, _ = await drive(session, f.url + path, bodies[:args.n1], stream, 1)
                    _, wall64 = await drive(session, f.url + path, bodies[args.n1:], stream, 64)
                    cell = cells[(f.name, kind, stream)]
                    cell.cpu_ms.append((proc_cpu_s(f.pid) - cpu0) * 1000 / n)
                    cell.p50_ms.append(statistics.median(lat1) * 1000)
                    cell.rps.append(args.n64 / wall64)
            print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return cells


def table(cells: dict, rounds: int, names: tuple[str, ...] | list[str] = ("proxy", "smg")) -> str:
    med = statistics.median
    lines = ["| path | stream | front | front CPU per request ms | c=1 p50 ms | c=64 req/s | token ids out |",
             "|---|---|---|---|---|---|---|"]
    for kind, stream in PATHS:
        for name in names:
            cell = cells[(name, kind, stream)]
            smg = name == "smg"
            where = {"chat": "/v1/chat/completions", "token-in": "/generate" if smg else "/inference/v1/generate"}[kind]
            ids = "yes" if not smg else ("SGLang's (token-in only)" if kind == "token-in" else "none")
            lines.append(f"| {kind} `{where}` | {'yes' if stream else 'no'} | {name} | {med(cell.cpu_ms):.2f} | "
                         f"{med(cell.p50_ms):.2f} | {med(cell.rps):.0f} | {ids} |")
    for name in names:
        diff = [c - t for c, t in zip(cells[(name, "chat", False)].cpu_ms, cells[(name, "token-in", False)].cpu_ms)]
        lines.append(f"\n{name}: chat minus token-in (render, tokenize, chat format), non-streamed, "
                     f"median of {rounds} rounds: {med(diff):.2f} ms CPU per request")
    return "\n".join(lines)


def smg_tokenizer_dir(source: str, parent: str | None = None) -> str:
    """A copy of the tokenizer folder with a config.json beside it, for SMG and the stand-in."""
    out = os.path.join(parent or tempfile.mkdtemp(prefix="smg-tokenizer-"), "qwen2")
    shutil.copytree(source, out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(MODEL_CONFIG, f)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smg-python", default="/tmp/venv-smg/bin/python",
                        help="a Python with smg 1.13, smg-grpc-proto and grpcio-tools")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--n1", type=int, default=80, help="requests at c=1 per cell")
    parser.add_argument("--n64", type=int, default=300, help="requests at c=64 per cell")
    parser.add_argument("--code", action="append", default=[],
                        help="a checkout to run the proxy from (repeatable), DIR or DIR:W1,W2 (its --workers counts)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1], help="the proxy's --workers (each a front)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from token_proxy.simulator.builtin_tokenizer import ensure_builtin_tokenizer

    tok_dir = str(ensure_builtin_tokenizer())
    smg_tok = smg_tokenizer_dir(tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)

    def token_ids(salt: int) -> list[int]:
        text = tok.apply_chat_template(chat_messages(salt), add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    ports = {name: free_port() for name in ("sim", "proxy", "standin", "smg", "smg_metrics")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    smg_bin = os.path.join(os.path.dirname(args.smg_python), "smg")
    procs = []
    try:
        procs.append(start([sys.executable, "-m", "token_proxy.simulator", "--port", str(ports["sim"]),
                            "--tokenizer", tok_dir, "--ttft-ms", "0", "--tpot-ms", "0", "--log-level", "warning"],
                           url["sim"]))
        proxies = []
        for spec in args.code or ["."]:
            code, _, counts = spec.partition(":")
            for workers in [int(w) for w in counts.split(",")] if counts else args.workers:
                port = free_port()
                env = {**os.environ, "PYTHONPATH": os.path.abspath(code)}
                proc = start([sys.executable, "-m", "token_proxy", "--backend", url["sim"], "--host", "127.0.0.1",
                              "--port", str(port), "--log-level", "warning", "--workers", str(workers)],
                             f"http://127.0.0.1:{port}", env=env, cwd=os.path.abspath(code))
                procs.append(proc)
                label = f"proxy {code} x{workers}" if len(args.code) > 1 else f"proxy x{workers}"
                proxies.append(Front(label, f"http://127.0.0.1:{port}", proc.pid, "/v1/chat/completions",
                                     "/inference/v1/generate"))
        standin = start_standin([args.smg_python, os.path.join(HERE, "smg_standin.py"), "--port",
                                 str(ports["standin"]), "--tokenizer", smg_tok, "--tokens", str(OUT_TOKENS)])
        procs.append(standin)
        smg = start([smg_bin, "launch", "--host", "127.0.0.1", "--port", str(ports["smg"]),
                     "--worker-urls", f"grpc://127.0.0.1:{ports['standin']}", "--model-path", smg_tok,
                     "--tokenizer-path", smg_tok, "--prometheus-host", "127.0.0.1",
                     "--prometheus-port", str(ports["smg_metrics"]), "--log-level", "warn"], url["smg"])
        procs.append(smg)
        wait_models(url["smg"])
        fronts = [*proxies, Front("smg", url["smg"], smg.pid, "/v1/chat/completions", "/generate")]
        t0 = time.monotonic()
        cells = asyncio.run(run_rounds(args, fronts, token_ids))
        wall = time.monotonic() - t0
    finally:
        for proc in reversed(procs):
            proc.terminate()
    prompt = len(token_ids(1))
    print(f"\n{args.rounds} interleaved rounds in {wall:.0f} s; per cell {args.n1} requests at c=1 then "
          f"{args.n64} at c=64; unique prompts of ~{prompt} tokens, {OUT_TOKENS} tokens out (ignore_eos); "
          f"proxy -> simulator (0 ms), SMG {smg_version(smg_bin)} gRPC -> stand-in scheduler (0 ms); "
          f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; medians over rounds")
    print(table(cells, args.rounds, [f.name for f in fronts]))


def start_standin(cmd: list[str]):
    """The stand-in has no HTTP /health: wait for its line on stdout."""
    import subprocess

    log = tempfile.NamedTemporaryFile(prefix="bench-standin-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        with open(log.name) as f:
            text = f.read()
        if "stand-in scheduler on" in text:
            return proc
        if proc.poll() is not None:
            raise SystemExit(f"{cmd} exited: {text[-2000:]}")
        time.sleep(0.2)
    raise SystemExit(f"{cmd} did not start (log: {log.name})")


def wait_models(base: str) -> None:
    """SMG answers /health before its gRPC worker is registered: wait until a chat goes through."""
    import urllib.error
    import urllib.request

    body = orjson.dumps({"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    end = time.monotonic() + 60
    while time.monotonic() < end:
        req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit("SMG never served a chat (is its worker registered?)")


def smg_version(smg_bin: str) -> str:
    import subprocess

    try:
        return subprocess.run([smg_bin, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout.split()[-1]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "?"


if __name__ == "__main__":
    main()
