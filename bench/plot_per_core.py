"""Requests per second per front core (1000 / CPU ms per request), per path, for every front of every run in a
figures file (bench/per_core_figures.json: CPU ms per request as bench/RESULTS.md reports them): a markdown table,
and with --plot a PNG, one panel per run (issue 40.4).

    python bench/plot_per_core.py                                   # the table
    python bench/plot_per_core.py --plot bench/per-core-2026-11-28.png

A run is {"id", "title", "source", "fronts": {front: {path: CPU ms per request}}}; add one to re-draw.
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
PATHS = ("chat", "token-in", "chat stream", "token-in stream")


def per_core(cpu_ms: float) -> float:
    return 1000.0 / cpu_ms


def table(runs: list[dict]) -> list[str]:
    lines = []
    for run in runs:
        paths = [p for p in PATHS if any(p in cells for cells in run["fronts"].values())]
        lines += [f"**{run['title']}** ({run['source']})", "",
                  "| front | " + " | ".join(f"{p}: ms / req/s per core" for p in paths) + " |",
                  "|---|" + "---:|" * len(paths)]
        for front, cells in run["fronts"].items():
            row = [f"{cells[p]:.2f} / **{per_core(cells[p]):,.0f}**" if p in cells else "–" for p in paths]
            lines.append(f"| {front} | " + " | ".join(row) + " |")
        if run.get("notes"):
            lines += ["", run["notes"]]
        lines.append("")
    return lines


def plot(runs: list[dict], path: str) -> None:
    import matplotlib as mpl

    mpl.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.6), squeeze=False)
    for axis, run in zip(axes[0], runs):
        paths = [p for p in PATHS if any(p in cells for cells in run["fronts"].values())]
        fronts = list(run["fronts"])
        width = 0.8 / len(fronts)
        for k, front in enumerate(fronts):
            cells = run["fronts"][front]
            xs = [i + (k - (len(fronts) - 1) / 2) * width for i, p in enumerate(paths) if p in cells]
            ys = [per_core(cells[p]) for p in paths if p in cells]
            bars = axis.bar(xs, ys, width, label=front)
            axis.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7)
        axis.set_xticks(range(len(paths)), paths, fontsize=8)
        axis.set_ylabel("requests per second per front core (1000 / CPU ms)")
        axis.set_title("\n".join(_wrap(run["title"], 60)), fontsize=8)
        axis.grid(axis="y", alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return [*lines, line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--figures", default=os.path.join(HERE, "per_core_figures.json"))
    parser.add_argument("--runs", nargs="*", help="only these run ids, in this order")
    parser.add_argument("--plot", help="also write this PNG (needs matplotlib)")
    args = parser.parse_args()
    with open(args.figures) as f:
        runs = json.load(f)["runs"]
    if args.runs:
        by_id = {run["id"]: run for run in runs}
        runs = [by_id[name] for name in args.runs]
    print("\n".join(table(runs)))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
