"""Where a bench point's CPU goes on this host, and CPU pinning (`bench_ceiling.py --pin`).

Process groups: SGLang's scheduler (`sglang_sched`), the rest of SGLang (`sglang_other`: the HTTP and
tokenizer manager, the detokenizer, ...), the proxy's process tree (`proxy`) and the bench's client
processes (`clients`). For each, every thread's /proc/PID/task/TID/schedstat is read at a point's start
and end: nanoseconds on a CPU, nanoseconds runnable but waiting in a run queue, and timeslices. The
run-queue wait is the profile of CPU contention: a scheduler that waits for a core while it has work
slows every target, whatever the target does. The host's load (procs_running sampled over the point,
/proc/loadavg, /proc/pressure/cpu where the kernel has it) goes beside.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field

CLK_TCK = os.sysconf("SC_CLK_TCK")
GROUPS = ("sglang_sched", "sglang_other", "proxy", "clients")
# `sglang` pins both SGLang groups; `sglang_sched` / `sglang_other` override it for their part.
PIN_GROUPS = ("sglang", *GROUPS)
# SGLang 0.5.17 names its processes with setproctitle (managers/scheduler.py: "sglang::scheduler" plus
# "_DP0", "_TP1", ... where those are > 1; detokenizer_manager.py: "sglang::detokenizer"); the main
# process (HTTP server and tokenizer manager) is `python -m sglang.launch_server`.
SCHED_TITLE = "sglang::scheduler"
PIN_EXAMPLE = "e.g. --pin sglang=0-5 --pin proxy=6-9 --pin clients=10-15"


# ---------------------------------------------------------------- processes

def proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, utime + stime in seconds) of every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return table


def descendants(pid: int, table: dict[int, tuple[int, float]] | None = None) -> list[int]:
    """Every live process below pid (children first)."""
    children: dict[int, list[int]] = {}
    for child, (parent, _) in (table or proc_table()).items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        found = children.get(todo.pop(), [])
        out += found
        todo += found
    return out


def children(pid: int) -> dict[int, str]:
    """pid -> command line of each live child of `pid` (one level: descendants() goes all the way)."""
    return {child: cmdline(child) for child, (parent, _) in proc_table().items() if parent == pid}


def tree_cpu_s(root: int) -> float:
    """utime + stime of root and every live descendant, in seconds."""
    table = proc_table()
    return sum(table[pid][1] for pid in [root, *descendants(root, table)] if pid in table)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def port_owners(port: int) -> set[int]:
    """The processes holding a socket that listens on this TCP port (empty where their fds are not
    readable: another user's server without root)."""
    inodes = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(path) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{cols[9]}]")
    owners = set()
    for entry in os.listdir("/proc") if inodes else ():
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                        owners.add(int(entry))
                        break
    return owners


def is_sglang(command: str) -> bool:
    return command.startswith("sglang::") or "sglang.launch_server" in command


def sglang_groups(port: int) -> dict[str, list[int]]:
    """SGLang's processes on this host: the tree of the SGLang process that listens on port, or, where
    that cannot be seen (another user's, a container's port mapping), every process that SGLang names."""
    table = proc_table()
    found = {pid for pid in port_owners(port) if is_sglang(cmdline(pid))}
    if not found:
        found = {pid for pid in table if is_sglang(cmdline(pid))}
    roots = [pid for pid in found if table.get(pid, (0, 0))[0] not in found]
    tree = set(roots).union(*(descendants(root, table) for root in roots))
    return split_sglang(tree)


def split_sglang(pids) -> dict[str, list[int]]:
    sched = sorted(pid for pid in pids if cmdline(pid).startswith(SCHED_TITLE))
    return {"sglang_sched": sched, "sglang_other": sorted(set(pids) - set(sched))}


# ---------------------------------------------------------------- schedstat

def parse_schedstat(text: str) -> tuple[int, int, int]:
    """/proc/.../schedstat: (ns on a CPU, ns runnable but waiting in a run queue, timeslices)."""
    on_cpu, wait, slices = text.split()[:3]
    return int(on_cpu), int(wait), int(slices)


def thread_stats(pids) -> dict[int, tuple[int, int, int]]:
    """tid -> schedstat of every thread of these processes (ones gone meanwhile are skipped)."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    out[int(tid)] = parse_schedstat(f.read())
            except (OSError, ValueError):
                continue
    return out


def cpu_s(pid: int) -> float:
    """On-CPU seconds of every thread of `pid` (schedstat: nanoseconds, where /proc's utime+stime
    counts 10 ms ticks)."""
    return sum(stat[0] for stat in thread_stats([pid]).values()) / 1e9


def stats_delta(before: dict, after: dict) -> tuple[float, float, int]:
    """(on-CPU s, run-queue wait s, timeslices) between two thread_stats: a thread born meanwhile
    counts whole; one that ended meanwhile is lost (its time left /proc with it)."""
    cpu = wait = slices = 0
    for tid, (c, w, s) in after.items():
        c0, w0, s0 = before.get(tid, (0, 0, 0))
        cpu, wait, slices = cpu + c - c0, wait + w - w0, slices + s - s0
    return cpu / 1e9, wait / 1e9, slices


def group_extra(group: str, delta: tuple[float, float, int], wall: float) -> dict:
    """A group's point as row.extra keys: cores used, run-queue wait per second of wall (summed over
    its threads), that wait per second on a CPU, timeslices per second."""
    cpu, wait, slices = delta
    out = {f"cpu_{group}": cpu / wall, f"wait_{group}_ms_per_s": wait * 1000 / wall,
           f"slices_{group}_per_s": slices / wall}
    if cpu > 0:
        out[f"wait_{group}_frac"] = wait / cpu
    return out


# ---------------------------------------------------------------- the host's load

def procs_running() -> int:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("procs_running "):
                return int(line.split()[1])
    return 0


def cpu_pressure_us() -> int | None:
    """/proc/pressure/cpu 'some' total: microseconds in which at least one task waited for a CPU."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class PointMeter:
    """One point's CPU by group (start() at the clients' go, stop() once every result is in) and the
    host's load over it: procs_running every 0.2 s from a thread of this (otherwise waiting) process."""
    groups: dict[str, list[int]]
    interval: float = 0.2
    _before: dict = field(default_factory=dict)
    _samples: list[int] = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._pressure = cpu_pressure_us()
        self._before = {group: thread_stats(pids) for group, pids in self.groups.items() if pids}
        self._t0 = time.perf_counter()
        self._samples.append(procs_running() - 1)  # less this process, running as it reads
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            self._samples.append(procs_running() - 1)  # less this sampler, running as it reads

    def stop(self) -> dict:
        wall = time.perf_counter() - self._t0
        self._samples.append(procs_running() - 1)  # a point shorter than the interval has two samples
        out = {}
        for group, before in self._before.items():
            after = thread_stats(self.groups[group])
            out.update(group_extra(group, stats_delta(before, after), wall))
            # The busiest thread: near 1.0, a Python event loop (SGLang's HTTP/tokenizer manager, a proxy
            # worker) is saturated even where the group's total looks small.
            out[f"hot_{group}"] = max(((c - before.get(tid, (0, 0, 0))[0]) / 1e9 / wall
                                       for tid, (c, _w, _s) in after.items()), default=0.0)
        self._done.set()
        self._thread.join()
        if self._samples:
            out["procs_running_mean"] = sum(self._samples) / len(self._samples)
        with open("/proc/loadavg") as f:
            out["loadavg_1m"] = float(f.read().split()[0])
        pressure = cpu_pressure_us()
        if pressure is not None and self._pressure is not None:
            out["cpu_pressure_some_pct"] = (pressure - self._pressure) / 1e4 / wall
        return out


# ---------------------------------------------------------------- pinning

def parse_cpulist(text: str) -> set[int]:
    """'0-5,8,10-11' (the kernel's cpulist syntax) -> {0, ..., 5, 8, 10, 11}."""
    cpus = set()
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        high = high if sep else low
        if not low.isdigit() or not high.isdigit() or int(high) < int(low):
            raise ValueError(f"'{text}' is not a CPU list")
        cpus.update(range(int(low), int(high) + 1))
    return cpus


def format_cpulist(cpus) -> str:
    cpus, runs = sorted(cpus), []
    for cpu in cpus:
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def parse_pins(specs: list[str], allowed: set[int]) -> dict[str, set[int]]:
    """--pin GROUP=CPULIST values -> {group: cpus}; a mistake raises ValueError in one line naming the fix."""
    pins = {}
    for spec in specs:
        group, sep, cpulist = spec.partition("=")
        if not sep:
            raise ValueError(f"--pin {spec}: expected GROUP=CPULIST, {PIN_EXAMPLE}")
        if group not in PIN_GROUPS:
            raise ValueError(f"--pin {spec}: unknown group '{group}', use one of {', '.join(PIN_GROUPS)} "
                             f"({PIN_EXAMPLE})")
        try:
            cpus = parse_cpulist(cpulist)
        except ValueError:
            raise ValueError(f"--pin {spec}: '{cpulist}' is not a CPU list, write it as 0-5,8 "
                             f"({PIN_EXAMPLE})") from None
        if not cpus <= allowed:
            raise ValueError(f"--pin {spec}: CPU {format_cpulist(cpus - allowed)} is not available to this "
                             f"process, pick from {format_cpulist(allowed)}")
        pins[group] = cpus
    return pins


def pins_for(pins: dict[str, set[int]], group: str) -> set[int] | None:
    return pins.get(group) or (pins.get("sglang") if group.startswith("sglang_") else None)


def pin(pids, cpus: set[int]) -> None:
    """Every thread of these processes onto cpus (threads started later inherit their creator's)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    os.sched_setaffinity(int(tid), cpus)
                except ProcessLookupError:
                    continue  # a thread that just ended
                except PermissionError:
                    raise SystemExit(f"--pin: may not set the CPU affinity of process {pid} ({cmdline(pid)[:60]}): "
                                     "run the bench as that process's user or as root") from None


def affinities(pids) -> dict[int, set[int]]:
    """tid -> CPU affinity of every thread of these processes (pid's own entry: its main thread's)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    out[int(tid)] = os.sched_getaffinity(int(tid))
    return out


def restore(saved: dict[int, set[int]], pids) -> None:
    """Every thread back to the affinity it had (one started since: its process's): SGLang outlives the
    bench, and the next run must not find it pinned."""
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                cpus = saved.get(int(tid)) or saved.get(pid)
                if cpus:
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(int(tid), cpus)


def pin_groups(pins: dict[str, set[int]], groups: dict[str, list[int]]) -> None:
    for group, pids in groups.items():
        if (cpus := pins_for(pins, group)) is not None:
            pin(pids, cpus)


# ---------------------------------------------------------------- tables

def fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def measured(extras) -> bool:
    """Whether any row carries this module's keys (older result files do not: their tables stay as they were)."""
    return any("procs_running_mean" in extra or "loadavg_1m" in extra for extra in extras)


SCHED_HEADER = "SGLang sched cores | SGLang sched wait ms/s"


def sched_cells(extra: dict) -> str:
    """The two telling cells for the main table: SGLang's scheduler's cores and its run-queue wait."""
    return f"{fmt(extra.get('cpu_sglang_sched'))} | {fmt(extra.get('wait_sglang_sched_ms_per_s'), 0)}"


def group_table(label_header: str, rows: list[tuple[str, dict]]) -> list[str]:
    """Every group's cores and run-queue wait (ms per s of wall), per row, with the host's load."""
    header = (f"| {label_header} | SGLang sched cores | sched wait ms/s | sched wait ÷ CPU | SGLang other cores "
              "| other wait ms/s | other busiest thread | proxy cores | proxy wait ms/s | proxy busiest thread "
              "| clients cores | clients wait ms/s "
              "| procs running | load 1m | CPU pressure % |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for label, x in rows:
        cells = [fmt(x.get("cpu_sglang_sched")), fmt(x.get("wait_sglang_sched_ms_per_s"), 0),
                 fmt(x.get("wait_sglang_sched_frac"))]
        for group in GROUPS[1:]:
            cells += [fmt(x.get(f"cpu_{group}")), fmt(x.get(f"wait_{group}_ms_per_s"), 0)]
            if group != "clients":
                cells.append(fmt(x.get(f"hot_{group}")))
        cells += [fmt(x.get("procs_running_mean"), 1), fmt(x.get("loadavg_1m"), 1),
                  fmt(x.get("cpu_pressure_some_pct"), 0)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def pin_line(pins: dict[str, str] | None) -> str:
    return "CPU pinning: " + (" ".join(f"{g}={c}" for g, c in pins.items()) if pins else "none")
