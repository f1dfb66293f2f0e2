"""One table (and a plot) from several bench_ceiling.py --json-out files.

The GPU machine's time limit splits the ceiling matrix into several runs; each file carries its own
ceiling rows, and every ratio is taken against the ceiling of the same file (the same hour: the host
is noisy, so only ratios within one run count).

    python bench/ceiling_report.py run1.json run2.json ... [--plot ceiling.png]

The plot (req/s and TTFT p50 against concurrency, one line per target, streams and not) needs
matplotlib (pip install matplotlib); the table does not. Files with the CPU profile by process group
(cpu_groups.py) add SGLang's scheduler's cores and run-queue wait to the table, a second table with
every group, and their CPU pinning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_groups
import proxy_roles

NAMES = {"generate": "SGLang /generate (pre-tokenized) = ceiling", "chat": "SGLang /v1/chat/completions",
         "generate_fresh": "SGLang /generate (pre-tokenized), a connection per request"}


def load(paths: list[str]) -> list[dict]:
    rows = []
    for run, path in enumerate(paths):
        with open(path) as f:
            rows.extend({**row, "run": run} for row in json.load(f))
    return rows


def name_of(row: dict) -> str:
    workers, flags = row["workers"], row.get("flags")
    name = NAMES.get(row["target"]) or f"proxy, {workers} worker{'s' if workers != 1 else ''}"
    return f"{name}, {flags}" if flags else name


def key_of(row: dict) -> tuple:
    """Rows compared with each other: the same run and point, and the same round of an interleaved run."""
    return row.get("run", 0), row["stream"], row["repeats"], row["concurrency"], row.get("round")


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def round_groups(rows: list[dict]) -> dict[tuple, list[tuple[dict, dict]]]:
    """Interleaved rows by (stream, repeats, concurrency, target name): each with its own round's ceiling."""
    rows = [r for r in rows if r.get("round") is not None]
    ceiling = {key_of(r): r for r in rows if r["target"] == "generate"}
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for r in rows:
        ceil = ceiling.get(key_of(r))
        if ceil is not None:
            groups.setdefault((r["stream"], r["repeats"], r["concurrency"], name_of(r)), []).append((r, ceil))
    return groups


def rounds_table(rows: list[dict]) -> list[str]:
    """Interleaved runs (bench_ceiling --interleave R): every target once per round, each round's ratios
    against that round's ceiling, and their median (min..max) over the rounds. Empty without rounds."""
    groups = round_groups(rows)
    if not groups:
        return []
    header = ("| stream | prompts | conc | target | rounds | ÷ ceiling, median (min..max) | req/s median "
              "| TTFT p50 ms median | TTFT − ceiling's, median (min..max) | proxy CPU ms/req median | errors |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    order = {"generate": 0, "generate_fresh": 1, "chat": 2, "proxy": 3}
    for key in sorted(groups, key=lambda k: (not k[0], k[1], k[2], order[groups[k][0][0]["target"]], k[3])):
        pairs = groups[key]
        r0 = pairs[0][0]
        ratios = [r["rps"] / c["rps"] for r, c in pairs if c["rps"]]
        ttft = [r["ttft50"] for r, _ in pairs]
        late = [r["ttft50"] - c["ttft50"] for r, c in pairs]
        cpu = [r["cpu_ms"] for r, _ in pairs if r["cpu_ms"] is not None]
        ratio = "-" if r0["target"] == "generate" else \
            f"{median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"
        delay = "-" if r0["target"] == "generate" or not r0["stream"] else \
            f"{median(late):+.0f} ({min(late):+.0f}..{max(late):+.0f})"
        lines.append(f"| {'yes' if key[0] else 'no'} | {'GRPO x8' if key[1] else 'distinct'} | {key[2]} | {key[3]} "
                     f"| {len(pairs)} | {ratio} | {median([r['rps'] for r, _ in pairs]):.1f} "
                     f"| {fmt(median(ttft), 0) if r0['stream'] else '-'} | {delay} "
                     f"| {fmt(median(cpu), 2) if cpu else '-'} | {sum(r['errors'] for r, _ in pairs)} |")
    return lines


def fmt(value, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def table(rows: list[dict]) -> list[str]:
    ceiling = {key_of(r): r for r in rows if r["target"] == "generate"}
    chat = {key_of(r): r for r in rows if r["target"] == "chat"}
    profiled = cpu_groups.measured(r.get("extra", {}) for r in rows)
    sched = f" {cpu_groups.SCHED_HEADER} |" if profiled else ""
    header = ("| stream | prompts | conc | target | n | req/s | ÷ ceiling | ÷ SGLang chat | p50 ms | TTFT p50 ms "
              f"| SGLang's TTFT mean ms | proxy CPU ms/req |{sched} errors |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    labelled = []
    order = {"generate": 0, "generate_fresh": 1, "chat": 2, "proxy": 3}
    for r in sorted(rows, key=lambda r: (not r["stream"], r["repeats"], r["concurrency"], r.get("round") or 0,
                                         order[r["target"]], r["workers"] or 0, r.get("flags") or "",
                                         r.get("run", 0))):
        ceil, ref = ceiling.get(key_of(r)), chat.get(key_of(r))
        ratio = f"{r['rps'] / ceil['rps']:.2f}" if ceil and r["target"] != "generate" else "-"
        vs_chat = f"{r['rps'] / ref['rps']:.2f}" if ref and r["target"] == "proxy" else "-"
        extra = r.get("extra", {})
        turn = f" (round {r['round']})" if r.get("round") is not None else ""
        label = (f"{'yes' if r['stream'] else 'no'} | {'GRPO x8' if r['repeats'] else 'distinct'} | {r['concurrency']} "
                 f"| {name_of(r)}{turn}")
        sched = f" {cpu_groups.sched_cells(extra)} |" if profiled else ""
        lines.append(
            f"| {label} | {r['n']} | {r['rps']:.1f} | {ratio} | {vs_chat} | {fmt(r['p50'], 0)} "
            f"| {fmt(r['ttft50'], 0) if r['stream'] else '-'} | {fmt(extra.get('sglang_ttft_ms'), 0)} "
            f"| {fmt(r['cpu_ms'], 2)} |{sched} {r['errors']} |")
        if cpu_groups.measured([extra]):  # rows of older files have none of it
            labelled.append((label, extra))
    if profiled:
        pins = sorted({cpu_groups.pin_line(x.get("pin")) for _, x in labelled})
        lines += ["", "CPU by process group (cores; run-queue wait in ms per second of wall, summed over threads); "
                  + "; ".join(pins) + ":", *cpu_groups.group_table("stream | prompts | conc | target", labelled)]
    return lines


def plot(rows: list[dict], path: str) -> None:
    import matplotlib as mpl

    mpl.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for col, stream in enumerate((True, False)):
        for target in sorted({name_of(r) for r in rows}):
            chosen = [r for r in rows if r["stream"] == stream and not r["repeats"] and name_of(r) == target]
            points = sorted(((r["concurrency"], r) for r in chosen), key=lambda p: (p[0], p[1]["run"]))
            if not points:
                continue
            conc = [c for c, _ in points]
            axes[0][col].plot(conc, [r["rps"] for _, r in points], marker="o", label=target)
            if stream:
                axes[1][col].plot(conc, [r["ttft50"] for _, r in points], marker="o", label=target)
            else:
                axes[1][col].plot(conc, [r["p50"] for _, r in points], marker="o", label=target)
        kind = "streamed" if stream else "not streamed"
        axes[0][col].set_title(f"req/s, {kind}, distinct prompts")
        axes[1][col].set_title("TTFT p50 (ms)" if stream else "latency p50 (ms), not streamed")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log")
            ax.set_xlabel("concurrency")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


SHORT = {NAMES["generate"]: "ceiling", NAMES["generate_fresh"]: "ceiling,\nconn/req", NAMES["chat"]: "SGLang\nchat"}


def plot_rounds(rows: list[dict], path: str) -> None:
    """Interleaved runs as bars: per point (stream, prompts, concurrency), each target's ÷ ceiling
    (median over rounds, min..max as the error bar) and its TTFT p50 (or latency p50, not streamed)."""
    import matplotlib as mpl

    mpl.use("Agg")
    import matplotlib.pyplot as plt

    groups = round_groups(rows)
    points = sorted({key[:3] for key in groups}, key=lambda p: (not p[0], p[1], p[2]))
    fig, axes = plt.subplots(2, len(points), figsize=(3.4 * len(points), 6), squeeze=False)
    for col, point in enumerate(points):
        names = sorted((key[3] for key in groups if key[:3] == point), key=lambda n: (not n.startswith("SGLang"), n))
        ratios, spans, times = [], [], []
        for name in names:
            pairs = groups[(*point, name)]
            values = [r["rps"] / c["rps"] for r, c in pairs]
            ratios.append(median(values))
            spans.append((median(values) - min(values), max(values) - median(values)))
            times.append(median([r["ttft50"] if point[0] else r["p50"] for r, _ in pairs]))
        labels = [SHORT.get(n) or n.replace("proxy, ", "x").replace(" workers", "").replace(" worker", "")
                  .replace(", --stream-coalesce-ms ", "\nco") for n in names]
        axes[0][col].bar(labels, ratios, yerr=list(zip(*spans)), capsize=3)
        axes[0][col].axhline(1.0, color="grey", lw=0.8)
        axes[1][col].bar(labels, times)
        kind = "stream" if point[0] else "not streamed"
        axes[0][col].set_title(f"{kind}, {'GRPO x8' if point[1] else 'distinct'}, c={point[2]}: ÷ ceiling", fontsize=9)
        axes[1][col].set_title("TTFT p50 ms" if point[0] else "latency p50 ms", fontsize=9)
        for ax in (axes[0][col], axes[1][col]):
            ax.tick_params(axis="x", labelsize=7)
            ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="bench_ceiling.py --json-out files")
    parser.add_argument("--plot", help="also write this PNG (needs matplotlib)")
    parser.add_argument("--plot-rounds", help="interleaved runs: bars of each target's ÷ ceiling (median, min..max) "
                        "and TTFT per point, to this PNG (needs matplotlib)")
    args = parser.parse_args()
    rows = load(args.files)
    print("\n".join(table(rows)))
    summary = rounds_table(rows)
    if summary:
        print("\nInterleaved rounds: each ratio against the same round's ceiling; median (min..max) over rounds:")
        print("\n".join(summary))
    roles = proxy_roles.roles_table(rows)
    if roles:
        print("\nProxy CPU per request by process role (supervisor apart from the serving processes):")
        print("\n".join(roles))
    if args.plot:
        plot(rows, args.plot)
    if args.plot_rounds:
        plot_rounds(rows, args.plot_rounds)


if __name__ == "__main__":
    main()
