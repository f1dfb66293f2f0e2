"""The honest ceiling: SGLang's /generate with ids tokenized before timing, SGLang's own chat, and the proxy.

A multi-process load generator (N client processes, each one asyncio + aiohttp event loop, pulling
request numbers from one shared counter) so the client is never the bottleneck. For every point
(stream or not, distinct prompts or GRPO-style groups, concurrency) each target gets the same kind
of prompts, never the same prompts: distinct prompts are new to the whole run, so the proxy's
render cache never hits; GRPO groups send each prompt 8 times in a row (render-cache and prefix-
cache hits, as a trainer's group does). SGLang's prefix cache is flushed before every point.

Targets:
  generate  SGLang POST /generate, input_ids rendered and tokenized before timing (the ceiling)
  chat      SGLang's own POST /v1/chat/completions (asks for token ids where SGLang allows it)
  proxy     token-proxy's POST /v1/chat/completions (return_token_ids), with each --proxy-workers N
            (passed as `token-proxy --workers N` once that flag exists; until then only 1 runs)

Reports req/s, the proxy's throughput divided by the ceiling's, p50/p99 latency, TTFT p50 (streams)
and the CPU the proxy's process tree used (utime+stime from /proc, as cores and as ms per request).
Every point also gets a CPU profile by process group (cpu_groups.py): the cores and the run-queue wait
(ms per second, from each thread's schedstat) of SGLang's scheduler, the rest of SGLang, the proxy and
the clients, and the host's load, so a slow point shows whether SGLang's scheduler waited for a core.
`--pin` puts each group on its own CPUs (os.sched_setaffinity on every thread) to remove that wait.

    # the GPU host, a live SGLang server:
    python bench/bench_ceiling.py --sglang http://127.0.0.1:30000 --proxy-workers 1 2 4
    # a dry run against the built-in simulator (no GPU; SGLang's own chat is not simulated):
    python bench/bench_ceiling.py --simulator --concurrency 1 16 --single-requests 20 --rounds 2
    # the GPU host, each group on its own cores (16 here):
    python bench/bench_ceiling.py --sglang http://127.0.0.1:30000 --pin sglang=0-5 --pin proxy=6-9 --pin clients=10-15
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_groups
import proxy_roles
from bench_proxy import free_port, start
from ceiling_report import rounds_table
from ceiling_report import table as report_table
from cpu_groups import descendants, pin, stats_delta, thread_stats, tree_cpu_s

GROUP = 8  # GRPO-style: each prompt sent this many times in a row
_unique = itertools.count(int(time.time()) % 1_000_000 * 10_000)  # new prompt texts across runs too


# ---------------------------------------------------------------- prompts and bodies

def chat_messages(k: int, facts: int) -> list[dict]:
    """A chat whose every fact names k, so no two prompts share more than the system prompt."""
    text = " ".join(f"Fact {i}: item {k}-{i} weighs {(i * 7919 + k * 104729) % 1000} grams." for i in range(facts))
    return [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": text + " Which item is heaviest?"}]


def prompt_plan(n: int, repeats: bool, facts: int) -> list[list[dict]]:
    """n prompts for one point and target: all new, or groups of GROUP identical ones."""
    if not repeats:
        return [chat_messages(next(_unique), facts) for _ in range(n)]
    groups = [chat_messages(next(_unique), facts) for _ in range((n + GROUP - 1) // GROUP)]
    return [groups[i // GROUP] for i in range(n)]


def chat_body(messages: list[dict], stream: bool, model: str, max_tokens: int, proxy: bool) -> bytes:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 1.0, "stream": stream}
    if proxy:
        body["return_token_ids"] = True
    elif not stream:  # SGLang refuses its token-id flags on streams
        body.update(return_token_ids=True, return_prompt_token_ids=True)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def generate_body(ids: list[int], stream: bool, max_tokens: int) -> bytes:
    return orjson.dumps({"input_ids": ids, "stream": stream, "sampling_params": {
        "max_new_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}})


async def tokenize_all(proxy: str, prompts: list[list[dict]]) -> list[list[int]]:
    """The very ids the proxy would render (before timing; these prompts are never sent to the proxy)."""
    out: dict[int, list[int]] = {}
    seen: dict[int, int] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as session:
        async def one(i):
            async with session.post(proxy + "/tokenize", json={"messages": prompts[i]}) as resp:
                out[i] = (await resp.json())["tokens"]
        todo = []
        for i, p in enumerate(prompts):
            if id(p) in seen:
                continue
            seen[id(p)] = i
            todo.append(one(i))
        await asyncio.gather(*todo)
    return [out[seen[id(p)]] for p in prompts]


# ---------------------------------------------------------------- the client processes

async def _one(session, url: str, body: bytes, stream: bool) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    ttft = None
    last = b""
    tokens = 0
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.read())[:300]!r}")
        if not stream:
            data = orjson.loads(await resp.read())
            total = time.perf_counter() - t0
            tokens = data["usage"]["completion_tokens"] if "usage" in data else data["meta_info"]["completion_tokens"]
            return total, total, tokens
        buffer = b""
        async for chunk in resp.content.iter_any():
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                data = event[6:]
                if ttft is None and (data.startswith(b'{"text"') or (
                        b'"role"' not in data and (b'"content":"' in data or b'"token_ids":[' in data))):
                    ttft = time.perf_counter() - t0
                last = data
                if b'"choices":[]' in data and b'"usage":{' in data:
                    tokens = orjson.loads(data)["usage"]["completion_tokens"]
    total = time.perf_counter() - t0
    if not tokens and last.startswith(b'{"text"'):  # native /generate: the last event's meta_info
        tokens = orjson.loads(last)["meta_info"]["completion_tokens"]
    return total, ttft if ttft is not None else total, tokens


async def _client(url, bodies, stream, concurrency, counter, n, ready, go, max_tokens, warmup, fresh) -> dict:
    lat, ttfts, errors, short = [], [], 0, 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=fresh),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as session:
        for body in warmup:  # connections and code paths; prompts of their own, never timed
            with contextlib.suppress(Exception):
                await _one(session, url, body, stream)
        await asyncio.to_thread(ready.wait)
        await asyncio.to_thread(go.wait)
        own0 = thread_stats([os.getpid()])  # the clients' CPU profile, read by each client itself

        def take() -> int:
            with counter.get_lock():
                i = counter.value
                counter.value = i + 1
            return i

        async def worker():
            nonlocal errors, short
            while (i := take()) < n:
                try:
                    total, ttft, produced = await _one(session, url, bodies[i], stream)
                    lat.append(total)
                    ttfts.append(ttft)
                    short += produced < max_tokens
                except Exception as exc:  # noqa: BLE001 - counted and shown, never hidden
                    errors += 1
                    if errors <= 3:
                        print(f"  error: {exc}", file=sys.stderr)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        t1 = time.perf_counter()
        own = stats_delta(own0, thread_stats([os.getpid()]))
    return {"lat": lat, "ttft": ttfts, "errors": errors, "short": short, "t0": t0, "t1": t1, "sched": own}


def _client_main(args, out, cpus):
    if cpus:  # before any thread starts: the ones to come inherit it
        pin([os.getpid()], cpus)
    out.put(asyncio.run(_client(*args)))


# ---------------------------------------------------------------- one point

@dataclass
class Row:
    target: str
    workers: int | None
    stream: bool
    repeats: bool
    concurrency: int
    n: int
    rps: float = 0.0
    p50: float = float("nan")
    p99: float = float("nan")
    ttft50: float = float("nan")
    cores: float | None = None
    cpu_ms: float | None = None
    errors: int = 0
    short: int = 0
    extra: dict = field(default_factory=dict)
    flags: str = ""  # the proxy's extra flags (--proxy-config)
    round: int | None = None  # --interleave: which round


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")


@dataclass
class Host:
    """What each point measures and pins: SGLang's processes (found once, at start-up), the pins asked for."""
    sglang: dict[str, list[int]]
    pins: dict[str, set[int]]
    unpinned: dict[int, set[int]] = field(default_factory=dict)  # SGLang's threads' affinity before --pin

    def groups(self, proxy_pid: int | None) -> dict[str, list[int]]:
        groups = dict(self.sglang)
        if proxy_pid:
            groups["proxy"] = [proxy_pid, *descendants(proxy_pid)]
        return groups


def run_point(row: Row, url: str, bodies: list[bytes], warmup: list[bytes], clients: int, flush_url: str | None,
              proxy_pid: int | None, max_tokens: int, host: Host) -> Row:
    procs_n = max(1, min(clients, row.concurrency))
    shares = [row.concurrency // procs_n + (p < row.concurrency % procs_n) for p in range(procs_n)]
    ctx = mp.get_context("fork")  # the bodies are inherited, not pickled
    counter = ctx.Value("q", 0)
    # A client that dies before a barrier breaks it (BrokenBarrierError) instead of hanging the run.
    ready, go = ctx.Barrier(procs_n + 1, timeout=900), ctx.Barrier(procs_n + 1, timeout=900)
    out = ctx.Queue()
    procs = [ctx.Process(target=_client_main, daemon=True, args=(
        (url, bodies, row.stream, share, counter, row.n, ready, go, max_tokens, warmup[p::procs_n][:2] or warmup[:1],
         row.target == "generate_fresh"),
        out, cpu_groups.pins_for(host.pins, "clients"))) for p, share in enumerate(shares)]
    for proc in procs:
        proc.start()
    ready.wait()
    if flush_url:  # every point starts from an empty prefix cache
        with contextlib.suppress(OSError), urllib.request.urlopen(
                urllib.request.Request(flush_url, data=b"{}", method="POST"), timeout=60):
            pass
    groups = host.groups(proxy_pid)
    cpu_groups.pin_groups(host.pins, groups)  # again each point: SGLang and the proxy start threads lazily
    meter = cpu_groups.PointMeter(groups)
    cpu0 = tree_cpu_s(proxy_pid) if proxy_pid else None
    roles0 = proxy_roles.snapshot(proxy_pid) if proxy_pid else None
    seen0 = sglang_ttft(flush_url)
    meter.start()
    row.extra["wall_from"] = time.time()  # access lines (--access-log) are matched to points by time
    go.wait()
    parts = [out.get() for _ in procs]
    row.extra["wall_to"] = time.time()
    row.extra.update(meter.stop())
    cpu1 = tree_cpu_s(proxy_pid) if proxy_pid else None
    roles1 = proxy_roles.snapshot(proxy_pid) if proxy_pid else None
    seen1 = sglang_ttft(flush_url)
    if seen0 and seen1 and seen1[1] > seen0[1]:  # SGLang's own TTFT (receipt to first token), this point's mean
        row.extra["sglang_ttft_ms"] = (seen1[0] - seen0[0]) * 1000 / (seen1[1] - seen0[1])
    for proc in procs:
        proc.join()
    lat = [x for p in parts for x in p["lat"]]
    ttft = [x for p in parts for x in p["ttft"]]
    wall = max(p["t1"] for p in parts) - min(p["t0"] for p in parts)
    row.rps = len(lat) / wall if wall > 0 else 0.0
    row.p50, row.p99 = pct(lat, 0.5), pct(lat, 0.99)
    row.ttft50 = pct(ttft, 0.5) if row.stream else float("nan")
    row.errors = sum(p["errors"] for p in parts)
    row.short = sum(p["short"] for p in parts)
    if wall > 0:
        clients_sched = [sum(x) for x in zip(*(p["sched"] for p in parts))]
        row.extra.update(cpu_groups.group_extra("clients", clients_sched, wall))
    if host.pins:
        row.extra["pin"] = {group: cpu_groups.format_cpulist(cpus) for group, cpus in host.pins.items()}
    if cpu0 is not None:
        # The counters move between the barrier and the first request by the clients' own wait only.
        row.cores = (cpu1 - cpu0) / wall if wall > 0 else None
        row.cpu_ms = (cpu1 - cpu0) * 1000 / max(1, len(lat))
    if roles0 is not None:  # by role: the supervisor (with --workers) apart from the serving processes
        row.extra["roles"] = proxy_roles.role_cells(proxy_roles.per_role(roles0, roles1, len(lat)))
    return row


def sglang_ttft(flush_url: str | None) -> tuple[float, float] | None:
    """SGLang's time_to_first_token_seconds (sum, count) from its /metrics (--enable-metrics), which
    tells SGLang's share of a late first token from the proxy's; None where it has no such metric."""
    if not flush_url:
        return None
    try:
        with urllib.request.urlopen(flush_url.rsplit("/", 1)[0] + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    total = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        for kind in total:
            if name.startswith(f"sglang:time_to_first_token_seconds_{kind}"):
                total[kind] += float(value.split()[0])
    return (total["sum"], total["count"]) if total["count"] else None


# ---------------------------------------------------------------- servers

def proxy_supports_workers() -> bool:
    out = subprocess.run([sys.executable, "-m", "token_proxy", "--help"], check=False, capture_output=True,
                         text=True).stdout
    return "--workers " in out or "--workers N" in out


def start_proxy(backend: str, workers: int, extra: list[str],
                profile: str | None = None) -> tuple[subprocess.Popen, str]:
    """With `profile` (a folder): py-spy samples the proxy's processes (speedscope JSON, written when
    the proxy stops) and the access lines, with their per-stage times, are kept there too."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "token_proxy", "--backend", backend, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "info" if profile else "warning", *extra]
    if workers != 1:
        cmd += ["--workers", str(workers)]
    if profile:
        os.makedirs(profile, exist_ok=True)
        spy = shutil.which("py-spy", path=f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}")
        if spy is None:
            raise SystemExit("--profile needs py-spy: pip install py-spy")
        cmd = [spy, "record", "--subprocesses", "--rate", "200", "--format", "speedscope", "--nonblocking",
               "-o", os.path.join(profile, f"proxy-x{workers}.speedscope.json"), "--", *cmd]
    proc = start(cmd, url)
    if workers != 1:  # /health answered by one worker: wait until fresh connections find every one ready
        ready = 0
        while ready < 4 * workers:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    ready = ready + 1 if resp.status == 200 else 0
            except OSError:
                ready = 0
                time.sleep(0.2)
    return proc, url


def start_simulator(tpot_ms: float, ttft_ms: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # As `token-proxy` starts it (and as the README recommends SGLang): incremental streams.
    cmd = [sys.executable, "-m", "token_proxy.simulator", "--host", "127.0.0.1", "--port", str(port),
           "--ttft-ms", str(ttft_ms), "--tpot-ms", str(tpot_ms), "--incremental-streaming-output",
           "--enable-deterministic-inference"]
    return start(cmd, url), url


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def stop(proc: subprocess.Popen, profile: str | None = None) -> None:
    if profile:  # py-spy writes its profile on SIGINT, then the proxy it ran is stopped
        tree = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        shutil.copy(proc.log_path, os.path.join(profile, f"proxy-{proc.pid}.log"))
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


# ---------------------------------------------------------------- the run

def points(args):
    for stream in args.stream:
        for prompts in args.prompts:
            for conc in args.concurrency:
                n = args.single_requests if conc == 1 else max(args.min_requests, conc * args.rounds)
                yield stream == "stream", prompts == "grpo", conc, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--sglang", help="a live SGLang server's URL")
    where.add_argument("--simulator", action="store_true", help="start the built-in simulator (a dry run)")
    parser.add_argument("--targets", nargs="+", default=["generate", "chat", "proxy"],
                        choices=["generate", "generate_fresh", "chat", "proxy"],
                        help="generate_fresh (with --interleave): the ceiling's requests, each on a new "
                        "connection that SGLang closes after it (Connection: close), as the proxy's stream relay "
                        "sends them")
    parser.add_argument("--proxy-workers", type=int, nargs="+", default=[1])
    parser.add_argument("--proxy-config", action="append", default=[], metavar="WORKERS[:FLAGS]",
                        help="a proxy to measure, instead of --proxy-workers (repeatable): its worker count and "
                        "extra token-proxy flags, e.g. --proxy-config 1 --proxy-config '1:--stream-coalesce-ms 20'")
    parser.add_argument("--interleave", type=int, default=0, metavar="R",
                        help="R rounds per point, every target once per round (order reversed every other "
                        "round), every proxy running throughout: each round's ratios are against its own "
                        "ceiling, so a noisy host's drift cancels (the table adds their median)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 256, 1024])
    parser.add_argument("--stream", nargs="+", default=["nonstream", "stream"], choices=["nonstream", "stream"])
    parser.add_argument("--prompts", nargs="+", default=["distinct", "grpo"], choices=["distinct", "grpo"])
    parser.add_argument("--clients", type=int, default=8, help="client processes")
    parser.add_argument("--rounds", type=int, default=4, help="requests per concurrency slot (c > 1)")
    parser.add_argument("--min-requests", type=int, default=256, help="at least this many requests (c > 1)")
    parser.add_argument("--single-requests", type=int, default=200, help="requests at concurrency 1")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--facts", type=int, default=31, help="prompt length knob: 31 facts ~ 838 tokens (Qwen2)")
    parser.add_argument("--proxy-arg", action="append", default=[], help="extra token-proxy flag (repeatable)")
    parser.add_argument("--sim-tpot-ms", type=float, default=0.0)
    parser.add_argument("--sim-ttft-ms", type=float, default=0.0)
    parser.add_argument("--json-out", help="also write the rows here")
    parser.add_argument("--profile", metavar="DIR", help="py-spy the proxy (speedscope files) and keep its access "
                        "lines (per-stage times) in DIR; its CPU column then includes py-spy's")
    parser.add_argument("--access-log", metavar="DIR", help="with --interleave: run the proxies at --log-level info and "
                        "keep their logs (one JSON access line per request, with its stage times) in DIR; "
                        "bench/access_stages.py reads them against the rows")
    parser.add_argument("--pin", action="append", default=[], metavar="GROUP=CPULIST",
                        help="run a group on these CPUs (repeatable; groups: sglang, sglang_sched, sglang_other, "
                        "proxy, clients), e.g. --pin sglang=0-5 --pin proxy=6-9 --pin clients=10-15")
    args = parser.parse_args()
    if not args.interleave and (args.access_log or "generate_fresh" in args.targets):
        raise SystemExit("--access-log and --targets generate_fresh need --interleave R (e.g. --interleave 1)")
    try:
        pins = cpu_groups.parse_pins(args.pin, os.sched_getaffinity(0))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None

    procs, host = [], None
    # `timeout` (gpu_round.sh) stops a long run with SIGTERM: clean up as on any exit, so no proxy is
    # left running and SGLang, which outlives the bench, is not left pinned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.simulator:
            sim, backend = start_simulator(args.sim_tpot_ms, args.sim_ttft_ms)
            procs.append(sim)
            if "chat" in args.targets:
                print("  the simulator has no /v1/chat/completions: target 'chat' skipped", file=sys.stderr)
                args.targets = [t for t in args.targets if t != "chat"]
        else:
            backend = args.sglang.rstrip("/")
        info = get_json(backend + "/server_info")
        host = find_host(args, backend, procs, pins)
        configs = proxy_configs(args)
        rows = (run_interleaved if args.interleave else run_all)(args, backend, configs, host)
    finally:
        if host and host.pins:
            cpu_groups.restore(host.unpinned, [pid for pids in host.sglang.values() for pid in pids])
        for proc in procs:
            stop(proc)
    print_table(args, info, rows)


def find_host(args, backend: str, procs: list[subprocess.Popen], pins: dict[str, set[int]]) -> Host:
    """SGLang's processes on this host (the simulator counts as SGLang's non-scheduler part: it has
    none), named on stderr so a wrong match shows; SGLang's pins applied."""
    if args.simulator:
        sglang = cpu_groups.split_sglang([procs[0].pid, *descendants(procs[0].pid)])
    else:
        sglang = cpu_groups.sglang_groups(urllib.parse.urlsplit(backend).port or 80)
    for group, pids in sglang.items():
        names = ", ".join(f"{pid} {cpu_groups.cmdline(pid)[:50]!r}" for pid in pids) or "none found"
        print(f"  {group}: {names}", file=sys.stderr)
    if not any(sglang.values()) and any(cpu_groups.pins_for(pins, g) for g in sglang):
        raise SystemExit(f"--pin sglang: no SGLang process on this host listens at {backend}: "
                         "run the bench on SGLang's host, or drop the sglang pin")
    unpinned = cpu_groups.affinities([pid for pids in sglang.values() for pid in pids])
    cpu_groups.pin_groups(pins, sglang)
    return Host(sglang, pins, unpinned)


def proxy_configs(args) -> list[tuple[int, str]]:
    """(workers, extra flags) of every proxy to measure."""
    if not args.proxy_config:
        configs = [(w, "") for w in args.proxy_workers]
    else:
        configs = []
        for spec in args.proxy_config:
            workers, _, flags = spec.partition(":")
            if not workers.strip().isdigit():
                raise SystemExit(f"--proxy-config {spec!r}: start with the worker count, e.g. '1:--stream-coalesce-ms 20'")
            configs.append((int(workers), flags.strip()))
    if not proxy_supports_workers() and any(w != 1 for w, _ in configs):
        print("  token-proxy has no --workers yet: runs only 1 worker", file=sys.stderr)
        configs = [(w, f) for w, f in configs if w == 1]
    return configs


@dataclass
class Warm:
    """What every point's bodies come from: the proxy that renders and tokenizes the ceiling's prompts,
    the served model's name, and the warm-up prompts (never timed), as messages and as ids."""
    render_url: str
    model: str
    messages: list[list[dict]]
    ids: list[list[int]]


def warm_up(args, render_url: str) -> Warm:
    model = get_json(render_url + "/v1/models")["data"][0]["id"]
    messages = [chat_messages(next(_unique), args.facts) for _ in range(2 * args.clients)]
    ids = asyncio.run(tokenize_all(render_url, messages))
    args.prompt_tokens = len(ids[0])
    return Warm(render_url, model, messages, ids)


def measure(args, row: Row, base_url: str, warm: Warm, flush: str, proxy_pid: int | None, host: Host) -> Row:
    """One target at one point: its bodies (prompts new to the run), timed with run_point."""
    plan = prompt_plan(row.n, row.repeats, args.facts)
    if row.target in ("generate", "generate_fresh"):  # SGLang's /generate, pre-tokenized
        ids = asyncio.run(tokenize_all(warm.render_url, plan))
        bodies = [generate_body(x, row.stream, args.max_tokens) for x in ids]
        warmup = [generate_body(x, row.stream, args.max_tokens) for x in warm.ids]
        url = base_url + "/generate"
    else:  # a chat: SGLang's own, or the proxy's
        proxy = row.target == "proxy"
        bodies = [chat_body(m, row.stream, warm.model, args.max_tokens, proxy=proxy) for m in plan]
        warmup = [chat_body(m, row.stream, warm.model, args.max_tokens, proxy=proxy) for m in warm.messages]
        url = base_url + "/v1/chat/completions"
    turn = "" if row.round is None else f"round {row.round} "
    who = f"proxy x{row.workers} {row.flags}".rstrip() if proxy_pid else row.target
    print(f"  {turn}{who} stream={row.stream} grpo={row.repeats} c={row.concurrency} n={row.n}", file=sys.stderr)
    return run_point(row, url, bodies, warmup, args.clients, flush, proxy_pid, args.max_tokens, host)


def run_interleaved(args, backend: str, configs: list[tuple[int, str]], host: Host) -> list[Row]:
    """Every point: --interleave rounds of (ceiling, SGLang's chat, each proxy), with every proxy started once
    and running throughout (an idle proxy costs nothing measurable)."""
    rows: list[Row] = []
    flush = backend + "/flush_cache"
    proxies = []
    try:
        logged = ["--log-level", "info"] if args.access_log else []
        for workers, flags in configs:
            proc, url = start_proxy(backend, workers, [*args.proxy_arg, *shlex.split(flags), *logged], args.profile)
            proxies.append((workers, flags, proc, url))
            cpu_groups.pin_groups(host.pins, host.groups(proc.pid))
        warm = warm_up(args, proxies[0][3])  # the first proxy renders the ceiling's prompts (measured or not)
        for stream, repeats, conc, n in points(args):
            for rnd in range(args.interleave):
                turns = [t for t in ("generate", "generate_fresh", "chat") if t in args.targets]
                turns += [p for p in proxies if "proxy" in args.targets]
                for turn in (turns if rnd % 2 == 0 else turns[::-1]):
                    if isinstance(turn, str):
                        row, base_url, proxy_pid = Row(turn, None, stream, repeats, conc, n), backend, None
                    else:
                        workers, flags, proc, base_url = turn
                        row, proxy_pid = Row("proxy", workers, stream, repeats, conc, n, flags=flags), proc.pid
                    row.round = rnd
                    rows.append(measure(args, row, base_url, warm, flush, proxy_pid, host))
                    saved(args, rows)
    finally:
        for workers, flags, proc, _url in proxies:
            stop(proc, args.profile)
            if args.access_log:
                os.makedirs(args.access_log, exist_ok=True)
                shutil.copy(proc.log_path, os.path.join(args.access_log, access_log_name(workers, flags)))
    return rows


def access_log_name(workers: int, flags: str) -> str:
    """The kept log of one proxy (--access-log): named by its worker count and flags."""
    slug = "".join(c if c.isalnum() else "-" for c in flags).strip("-")
    return f"proxy-x{workers}{'-' + slug if slug else ''}.log"


def run_all(args, backend: str, configs: list[tuple[int, str]], host: Host) -> list[Row]:
    rows = []
    flush = backend + "/flush_cache"
    workers, flags = (configs or [(1, "")])[0]
    proxy, proxy_url = start_proxy(backend, workers, [*args.proxy_arg, *shlex.split(flags)], args.profile)
    cpu_groups.pin_groups(host.pins, host.groups(proxy.pid))
    try:
        warm = warm_up(args, proxy_url)
        # The ceiling and SGLang's own chat: once, whatever the proxy's worker count.
        for stream, repeats, conc, n in points(args):
            for target in ("generate", "chat"):
                if target in args.targets:
                    rows.append(measure(args, Row(target, None, stream, repeats, conc, n), backend, warm, flush,
                                        None, host))
                    saved(args, rows)
        if "proxy" in args.targets:
            for i, (workers, flags) in enumerate(configs):
                if i:
                    stop(proxy, args.profile)
                    proxy, proxy_url = start_proxy(backend, workers, [*args.proxy_arg, *shlex.split(flags)],
                                                   args.profile)
                    cpu_groups.pin_groups(host.pins, host.groups(proxy.pid))
                for stream, repeats, conc, n in points(args):
                    rows.append(measure(args, Row("proxy", workers, stream, repeats, conc, n, flags=flags), proxy_url,
                                        warm, flush, proxy.pid, host))
                    saved(args, rows)
    finally:
        stop(proxy, args.profile)
    return rows


def saved(args, rows: list[Row]) -> None:
    """Each point as it finishes: a line on stderr and the --json-out file rewritten, so a run stopped
    by a time limit keeps every point it finished (the table is printed only at the end)."""
    r = rows[-1]
    print(f"    -> {r.rps:.1f} req/s, p50 {r.p50:.1f} ms, TTFT p50 {r.ttft50:.1f} ms, cpu {r.cpu_ms} ms/req, "
          f"errors {r.errors}", file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([row.__dict__ for row in rows], f, indent=1)


def print_table(args, info: dict, rows: list[Row]) -> None:
    """The run's header line, then ceiling_report.py's tables of these rows (one way to print a run)."""
    kind = "built-in simulator" if args.simulator else f"SGLang {info.get('version')}"
    streams = "incremental" if info.get("incremental_streaming_output") else "cumulative"
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {kind} ({streams} streams), model "
          f"{info.get('model_path')}; ~{getattr(args, 'prompt_tokens', '?')}-token chat prompts, {args.max_tokens} "
          f"output tokens (ignore_eos, temperature 1); {args.clients} client processes; "
          f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    dicts = [row.__dict__ for row in rows]
    print("\n".join(report_table(dicts)))
    roles = proxy_roles.roles_table(dicts)
    if roles:
        print("\nProxy CPU per request by process role (bench/proxy_roles.py; schedstat, so it may differ from the "
              "cpu column's utime+stime):")
        print("\n".join(roles))
    summary = rounds_table(dicts)
    if summary:
        print("\nInterleaved rounds: each ratio against the same round's ceiling; median (min..max) over rounds:")
        print("\n".join(summary))

if __name__ == "__main__":
    main()
