"""Where each point's first tokens went, from the proxy's own access lines (bench_ceiling.py --access-log).

For every proxy row of a run, the access lines of that proxy logged while the point ran, against the client's
TTFT and SGLang's own (its /metrics): p50 of the proxy's stages, from the request's start in the proxy:
- `sent_s`: parse + render + admission, until the /generate call was sent;
- `ttft_s - sent_s`: from sending to SGLang until the first chunk was written to the client (SGLang's part,
  its front end's included, plus the proxy's relay of that first event);
- `client TTFT - ttft_s`: what the client waited outside the proxy's handler (sockets, aiohttp's reading
  of the request, the middleware, the loop's queue).

    python bench/access_stages.py rows.json LOG_DIR
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ceiling import access_log_name
from ceiling_report import fmt, name_of


def access_lines(path: str) -> list[dict]:
    lines = []
    with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as f:
        for line in f:
            if line.startswith("{") and '"endpoint"' in line:
                entry = json.loads(line)
                if entry.get("endpoint") == "/v1/chat/completions" and entry.get("status") == 200:
                    lines.append(entry)
    return lines


def p50(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def ms(entries: list[dict], key: str) -> float | None:
    return p50([e[key] * 1000 for e in entries if e.get(key) is not None])


def stages(rows: list[dict], log_dir: str) -> list[str]:
    logs: dict[str, list[dict]] = {}
    header = ("| stream | prompts | conc | target | round | requests logged | client TTFT p50 ms | proxy: sent p50 ms "
              "| proxy: render p50 ms (misses) | proxy: sent → first chunk p50 ms | SGLang's TTFT mean ms "
              "| client TTFT − proxy ttft, p50 ms |")
    out = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        if row["target"] != "proxy" or "wall_from" not in row["extra"]:
            continue
        name = access_log_name(row["workers"], row.get("flags") or "")
        if name not in logs:
            path = os.path.join(log_dir, name)
            path = path if os.path.exists(path) else path + ".xz"  # kept compressed in the repository
            logs[name] = access_lines(path) if os.path.exists(path) else []
        t0, t1 = row["extra"]["wall_from"], row["extra"]["wall_to"]
        mine = [e for e in logs[name] if t0 <= e["ts"] <= t1 + 1.0 and e.get("stream") == row["stream"]]
        after = p50([(e["ttft_s"] - e["sent_s"]) * 1000 for e in mine if e.get("ttft_s") is not None
                     and e.get("sent_s") is not None])
        renders = p50([e["render_s"] * 1000 for e in mine if e.get("render_s")])
        ttft = ms(mine, "ttft_s")
        outside = row["ttft50"] - ttft if ttft is not None and row["stream"] else None
        out.append(f"| {'yes' if row['stream'] else 'no'} | {'GRPO x8' if row['repeats'] else 'distinct'} "
                   f"| {row['concurrency']} | {name_of(row)} | {row.get('round')} | {len(mine)} "
                   f"| {fmt(row['ttft50'], 0) if row['stream'] else '-'} | {fmt(ms(mine, 'sent_s'), 1)} | {fmt(renders, 2)} "
                   f"| {fmt(after, 0)} | {fmt(row['extra'].get('sglang_ttft_ms'), 0)} | {fmt(outside, 0)} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", help="bench_ceiling.py --json-out file")
    parser.add_argument("log_dir", help="bench_ceiling.py --access-log folder")
    args = parser.parse_args()
    with open(args.rows) as f:
        rows = json.load(f)
    print("\n".join(stages(rows, args.log_dir)))


if __name__ == "__main__":
    main()
