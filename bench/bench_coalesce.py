"""×N that adds up, or what it costs in latency (issue 40.3): CPU per stream against the latency that
`--stream-coalesce-ms` adds, at `--workers 1` and `--workers N`, at the same total load.

One simulator (incremental streams, `--tpot-ms` per token) and one proxy per (coalesce setting, worker count),
all running throughout; interleaved rounds (order reversed every other round) drive each proxy with the same
number of streamed chats at the same concurrency, from a client process of its own (bench_workers_cpu.py's
driver, which this reuses). Per point: the proxy's CPU per stream (every process of its tree, supervisor
included), reads per stream, and what the client saw: the gap between successive token-bearing reads
(vLLM's benchmark_serving "ITL": one per chunk, so a coalesced chunk is one long gap) and what it adds over the
same worker count with coalescing off, tokens per read, and each token's lateness against the engine's pace (its
arrival minus the stream's first token's arrival minus k × tpot; on a loaded box the simulator's own drift
dominates it, so the plot uses the ITL).

    python bench/bench_coalesce.py --coalesce 0 1 2 5 10 20 40 --workers 1 4 --rounds 3 \\
        --json-out bench/results-2026-11-28/coalesce.json --plot bench/coalesce-2026-11-28.png
    python bench/bench_coalesce.py --from-json bench/results-2026-11-28/coalesce.json --plot out.png  # re-draw
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import sys
import time

import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_proxy import free_port, start
from bench_workers_cpu import chat_body, drive, get_json, start_proxy
from bench_workers_cpu import run_point as workers_point


def tokens_in(chunk: bytes) -> int:
    """The token ids a read carried: the sum over its SSE frames' choices' `token_ids`."""
    n = 0
    for frame in chunk.split(b"\n\n"):
        if not frame.startswith(b"data: {"):
            continue
        for choice in orjson.loads(frame[6:]).get("choices") or ():
            n += len(choice.get("token_ids") or ())
    return n


async def _drive(url: str, bodies: list[bytes], concurrency: int, tpot_s: float) -> dict:
    """Streams `bodies` at `concurrency`; per token-bearing read: the gap since the stream's previous one,
    its token count, and each token's lateness against the pace set by the stream's first token."""
    gaps, sizes, late = [], [], []
    result = await drive(url, bodies, concurrency, lambda resp: _one_stream(resp, tpot_s, gaps, sizes, late))
    return {**result, "gaps_ms": _quantiles(gaps), "late_ms": _quantiles(late),
            "tokens_per_read": sum(sizes) / max(1, len(sizes))}


async def _one_stream(resp, tpot_s: float, gaps: list, sizes: list, late: list) -> None:
    buffer, first, previous, seen = b"", None, None, 0
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        buffer += data
        whole, _, buffer = buffer.rpartition(b"\n\n")
        n = tokens_in(whole) if whole else 0
        if not n:
            continue
        if first is None:
            first = now
        else:
            gaps.append(now - previous)
            sizes.append(n)
        late.extend(now - first - (seen + i) * tpot_s for i in range(n))
        previous, seen = now, seen + n


def _quantiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"p50": 0.0, "p99": 0.0}
    q = statistics.quantiles(values, n=100)
    return {"p50": q[49] * 1000, "p99": q[98] * 1000}


def run_point(url: str, root: int, bodies: list[bytes], concurrency: int, tpot_s: float) -> dict:
    point = workers_point(url, root, bodies, concurrency, functools.partial(_drive, tpot_s=tpot_s))
    point.pop("roles")
    return point


def measure(args) -> dict:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sim_port = free_port()
    backend = f"http://127.0.0.1:{sim_port}"
    sim = start([sys.executable, "-m", "token_proxy.simulator", "--host", "127.0.0.1", "--port", str(sim_port),
                 "--tpot-ms", str(args.tpot_ms), "--incremental-streaming-output"], backend)
    proxies, tpot_s = [], args.tpot_ms / 1000
    points: dict[str, dict] = {}
    try:
        for ms in args.coalesce:
            for workers in args.workers:
                proc, url = start_proxy(args.code, backend, workers, ["--stream-coalesce-ms", str(ms)])
                name = f"x{workers} coalesce {ms:g} ms"
                proxies.append((name, proc, url))
                points[name] = {"workers": workers, "coalesce_ms": ms, "runs": []}
        model = get_json(proxies[0][2] + "/v1/models")["data"][0]["id"]
        serial = iter(range(int(time.time()) % 100_000 * 10_000, 10**12))
        for _name, proc, url in proxies:  # warm-up, not timed
            run_point(url, proc.pid, [chat_body(next(serial), model, args.tokens) for _ in range(8)], 8, tpot_s)
        for rnd in range(args.rounds):
            for name, proc, url in (proxies if rnd % 2 == 0 else proxies[::-1]):
                bodies = [chat_body(next(serial), model, args.tokens) for _ in range(args.streams)]
                point = run_point(url, proc.pid, bodies, args.concurrency, tpot_s)
                points[name]["runs"].append(point)
                print(f"  round {rnd} {name}: {point['cells']['total_ms']:.2f} ms/stream, reads "
                      f"{point['cells']['reads']:.1f}, ITL p50/p99 {point['gaps_ms']['p50']:.1f}/"
                      f"{point['gaps_ms']['p99']:.1f} ms, errors {point['errors']}", file=sys.stderr)
                if args.json_out:
                    with open(args.json_out, "wb") as f:
                        f.write(orjson.dumps(_document(args, points), option=orjson.OPT_INDENT_2))
    finally:
        for _, proc, _ in proxies:
            proc.terminate()
            proc.wait(timeout=60)
        sim.terminate()
    return _document(args, points)


def _document(args, points: dict) -> dict:
    setup = (f"{args.rounds} interleaved rounds x {args.streams} streams at c={args.concurrency}, {args.tokens} tokens "
             f"each, simulator tpot {args.tpot_ms:g} ms; {os.cpu_count()} cores; medians over rounds")
    return {"setup": setup, "tpot_ms": args.tpot_ms, "points": points}


def summary(doc: dict) -> list[dict]:
    """One row per point: medians over rounds, and the ×N / ×1 CPU ratio at the same coalesce setting."""
    rows = []
    for name, point in doc["points"].items():
        runs = point["runs"]
        med = statistics.median
        rows.append({"name": name, "workers": point["workers"], "coalesce_ms": point["coalesce_ms"],
                     "cpu_ms": med(r["cells"]["total_ms"] for r in runs),
                     "cpu_lo": min(r["cells"]["total_ms"] for r in runs),
                     "cpu_hi": max(r["cells"]["total_ms"] for r in runs),
                     "reads": med(r["cells"]["reads"] for r in runs),
                     "wakeups": med(r["cells"]["wakeups"] for r in runs),
                     "tokens_per_read": med(r["tokens_per_read"] for r in runs),
                     "itl_p50": med(r["gaps_ms"]["p50"] for r in runs), "itl_p99": med(r["gaps_ms"]["p99"] for r in runs),
                     "late_p50": med(r["late_ms"]["p50"] for r in runs), "late_p99": med(r["late_ms"]["p99"] for r in runs),
                     "rate": med(r["done"] / r["wall"] for r in runs)})
    one = {row["coalesce_ms"]: row["cpu_ms"] for row in rows if row["workers"] == 1}
    base = {row["workers"]: row for row in rows if row["coalesce_ms"] == min(r["coalesce_ms"] for r in rows)}
    for row in rows:
        row["vs_x1"] = row["cpu_ms"] / one[row["coalesce_ms"]] if row["coalesce_ms"] in one else None
        row["vs_x1_off"] = row["cpu_ms"] / base[1]["cpu_ms"] if 1 in base else None
        ref = base.get(row["workers"])
        row["added_p50"] = row["itl_p50"] - ref["itl_p50"] if ref else None
        row["added_p99"] = row["itl_p99"] - ref["itl_p99"] if ref else None
    return rows


def table(doc: dict) -> list[str]:
    lines = [doc["setup"], "",
             ("| workers | coalesce ms | proxy CPU ms per stream (min..max) | ×N / ×1, same setting | ×N / ×1 off | "
              "reads | wake-ups | tokens per read | ITL p50 / p99 ms | ITL added vs off, p50 / p99 ms | "
              "token lateness p50 / p99 ms | streams/s |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines.extend(
        f"| {r['workers']} | {r['coalesce_ms']:g} | {r['cpu_ms']:.2f} ({r['cpu_lo']:.2f}..{r['cpu_hi']:.2f}) | "
        f"{r['vs_x1']:.2f} | {r['vs_x1_off']:.2f} | {r['reads']:.1f} | {r['wakeups']:.1f} | "
        f"{r['tokens_per_read']:.2f} | {r['itl_p50']:.1f} / {r['itl_p99']:.1f} | "
        f"{r['added_p50']:+.1f} / {r['added_p99']:+.1f} | {r['late_p50']:.0f} / {r['late_p99']:.0f} | "
        f"{r['rate']:.1f} |"
        for r in sorted(summary(doc), key=lambda r: (r["workers"], r["coalesce_ms"])))
    return lines


def plot(doc: dict, path: str) -> None:
    import matplotlib as mpl

    mpl.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary(doc)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for workers, marker in zip(sorted({r["workers"] for r in rows}), "os^D"):
        mine = sorted((r for r in rows if r["workers"] == workers), key=lambda r: r["coalesce_ms"])
        for axis, key in ((left, "added_p50"), (right, "added_p99")):
            axis.plot([r[key] for r in mine], [r["cpu_ms"] for r in mine], marker=marker, label=f"--workers {workers}")
            for r in mine:
                axis.annotate(f"{r['coalesce_ms']:g}", (r[key], r["cpu_ms"]), textcoords="offset points",
                              xytext=(4, 4), fontsize=8)
    one_off = next((r["cpu_ms"] for r in rows if r["workers"] == 1 and r["coalesce_ms"] == 0), None)
    for axis, which in ((left, "p50"), (right, "p99")):
        if one_off is not None:
            axis.axhline(one_off * 1.1, color="grey", linestyle="--", linewidth=1, label="1.1 × (×1, coalescing off)")
        axis.set_xlabel(f"inter-token latency (gap between token-bearing reads) added vs coalescing off, {which} (ms)",
                        fontsize=8)
        axis.set_ylabel("proxy CPU per stream (ms)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle("--stream-coalesce-ms (labels, ms): CPU per 128-token stream against the latency it adds\n"
                 + doc["setup"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", default=".", help="the checkout to run the proxy from")
    parser.add_argument("--coalesce", type=float, nargs="+", default=[0, 1, 2, 5, 10, 20, 40])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--tpot-ms", type=float, default=20.0)
    parser.add_argument("--json-out")
    parser.add_argument("--from-json", help="no run: the table (and --plot) from an earlier --json-out")
    parser.add_argument("--plot", help="also write this PNG (needs matplotlib)")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json, "rb") as f:
            doc = orjson.loads(f.read())
    else:
        doc = measure(args)
    print("\n".join(table(doc)))
    if args.plot:
        plot(doc, args.plot)


if __name__ == "__main__":
    main()
