"""The proxy's CPU by process role (issue 30.3): with `--workers N` the `token-proxy` process is a supervisor
(it also runs the admin owner) and N serving processes serve the clients; with one process it serves itself.

A snapshot reads, for every process of the proxy's tree: its role, the on-CPU nanoseconds of all its threads
(/proc/PID/task/*/schedstat), the read and write system calls it made (/proc/PID/io syscr, syscw: uvloop reads
and writes sockets with read()/writev(), so these count network reads and writes) and its main thread's
timeslices (about one per event-loop wake-up). Two snapshots make a per-stream table by role, which
bench_ceiling.py and bench_workers_cpu.py print.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from cpu_groups import cmdline, descendants, thread_stats

SERVING_MODULE = "token_proxy.serving.process"
ROLES = ("single", "supervisor", "serving", "other")


@dataclass(frozen=True)
class ProcStat:
    role: str
    cpu_ns: int
    reads: int
    writes: int
    wakeups: int


def role_of(pid: int, root: int, serving_children: bool) -> str:
    """single: a one-process proxy; supervisor: the --workers root; serving: a --workers serving process;
    other: anything else in the tree (the simulator the proxy started when it had no --backend)."""
    if pid == root:
        return "supervisor" if serving_children else "single"
    return "serving" if SERVING_MODULE in cmdline(pid) else "other"


def _io(pid: int) -> tuple[int, int]:
    try:
        with open(f"/proc/{pid}/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["syscr"]), int(fields["syscw"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def _main_thread_slices(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 0


def snapshot(root: int) -> dict[int, ProcStat]:
    """pid -> ProcStat of the proxy rooted at `root` (the `token-proxy` process) and every descendant."""
    pids = [root, *descendants(root)]
    serving_children = any(SERVING_MODULE in cmdline(pid) for pid in pids[1:])
    out = {}
    for pid in pids:
        cpu = sum(stat[0] for stat in thread_stats([pid]).values())
        reads, writes = _io(pid)
        out[pid] = ProcStat(role_of(pid, root, serving_children), cpu, reads, writes, _main_thread_slices(pid))
    return out


def per_role(before: dict[int, ProcStat], after: dict[int, ProcStat], streams: int) -> dict[str, dict]:
    """role -> {cpu_ms, reads, writes, wakeups} per stream over the processes of that role (a process born
    meanwhile counts whole), plus `processes` and, for serving processes, `cpu_ms_each` (each process's
    share: the kernel's spread of connections)."""
    streams = max(1, streams)
    out: dict[str, dict] = {}
    for pid, now in after.items():
        was = before.get(pid, ProcStat(now.role, 0, 0, 0, 0))
        row = out.setdefault(now.role, {"processes": 0, "cpu_ms": 0.0, "reads": 0.0, "writes": 0.0, "wakeups": 0.0,
                                        "cpu_ms_each": []})
        cpu_ms = (now.cpu_ns - was.cpu_ns) / 1e6 / streams
        row["processes"] += 1
        row["cpu_ms"] += cpu_ms
        row["reads"] += (now.reads - was.reads) / streams
        row["writes"] += (now.writes - was.writes) / streams
        row["wakeups"] += (now.wakeups - was.wakeups) / streams
        row["cpu_ms_each"].append(cpu_ms)
    for row in out.values():
        row["cpu_ms_each"].sort(reverse=True)
    return out


def total_ms(roles: dict[str, dict], exclude: tuple[str, ...] = ("other",)) -> float:
    """The proxy's CPU per stream over its roles (the simulator it started, `other`, left out)."""
    return sum(row["cpu_ms"] for role, row in roles.items() if role not in exclude)


def role_cells(roles: dict[str, dict]) -> dict[str, float]:
    """The per-stream numbers a table shows: CPU of the serving side (single or serving processes), of the
    supervisor, their total, and the serving side's reads, writes and wake-ups per stream."""
    serving = roles.get("single") or roles.get("serving") or {}
    sup = roles.get("supervisor", {})
    return {"serving_ms": serving.get("cpu_ms", 0.0), "supervisor_ms": sup.get("cpu_ms", 0.0),
            "total_ms": total_ms(roles), "reads": serving.get("reads", 0.0), "writes": serving.get("writes", 0.0),
            "wakeups": serving.get("wakeups", 0.0), "supervisor_wakeups": sup.get("wakeups", 0.0),
            "spread": _spread(serving.get("cpu_ms_each", []))}


def _spread(each: list[float]) -> float:
    """The busiest serving process's CPU over the mean (1.0: an even spread; 4.0 at x4: one took all)."""
    if len(each) < 2 or not sum(each):
        return 1.0
    return max(each) / (sum(each) / len(each))


COLUMNS = (("serving_ms", "serving CPU ms", 2), ("supervisor_ms", "supervisor CPU ms", 3), ("total_ms", "proxy CPU ms", 2),
           ("reads", "reads", 1), ("writes", "writes", 1), ("wakeups", "wake-ups", 1),
           ("supervisor_wakeups", "supervisor wake-ups", 2), ("spread", "busiest/mean", 2))


def median_cell(values: list[float], digits: int) -> str:
    """The median, and (min..max) when there are several values."""
    if not values:
        return "-"
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.{digits}f}"
    return f"{mid:.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f})"


def roles_table(rows: list[dict]) -> list[str]:
    """bench_ceiling's rows (dicts) that carry `extra["roles"]`: one line per proxy and point, the median
    (min..max) over its rounds, per request."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        cells = row.get("extra", {}).get("roles")
        if cells:
            key = (f"proxy x{row['workers']} {row.get('flags') or ''}".rstrip(), row["stream"], row["concurrency"])
            groups.setdefault(key, []).append(cells)
    if not groups:
        return []
    lines = ["| proxy | stream | c | " + " | ".join(label for _, label, _ in COLUMNS) + " |",
             "|---|---|---:|" + "---:|" * len(COLUMNS)]
    for (name, stream, conc), runs in groups.items():
        cells = [median_cell([r[key] for r in runs], digits) for key, _, digits in COLUMNS]
        lines.append(f"| {name} | {'yes' if stream else 'no'} | {conc} | " + " | ".join(cells) + " |")
    return lines
