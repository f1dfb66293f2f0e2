"""bench/cpu_groups.py, which bench_ceiling.py's CPU profile and --pin stand on: the schedstat reader and
its arithmetic, the --pin parser's values and one-line errors, SGLang's processes found by the port they
listen on (stand-ins named as SGLang 0.5.17 names its own), and pinning a live process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from tests.support.bench_modules import load_bench_module


@pytest.fixture(scope="module")
def cg():
    return load_bench_module("cpu_groups")


def test_schedstat_fields(cg):
    assert cg.parse_schedstat("1234567 89 12\n") == (1234567, 89, 12)


def test_thread_stats_reads_every_thread_of_this_process(cg):
    started, done = threading.Event(), threading.Event()
    tid = []

    def idle():
        tid.append(threading.get_native_id())
        started.set()
        done.wait()

    thread = threading.Thread(target=idle)
    thread.start()
    started.wait()
    try:
        stats = cg.thread_stats([os.getpid(), 999_999_999])  # a pid that does not exist is skipped
    finally:
        done.set()
        thread.join()
    assert {os.getpid(), tid[0]} <= set(stats)
    assert stats[os.getpid()][0] > 0 and stats[os.getpid()][2] > 0


def test_delta_counts_a_new_thread_whole_and_drops_an_ended_one(cg):
    before = {1: (10, 5, 1), 2: (100, 0, 3)}
    after = {1: (1_000_000_010, 2_000_005, 4), 3: (500_000_000, 0, 2)}
    assert cg.stats_delta(before, after) == (1.5, 0.002, 5)


def test_group_extra_per_second_of_wall(cg):
    assert cg.group_extra("sglang_sched", (1.5, 0.25, 300), 2.0) == {
        "cpu_sglang_sched": 0.75, "wait_sglang_sched_ms_per_s": 125.0, "slices_sglang_sched_per_s": 150.0,
        "wait_sglang_sched_frac": 0.25 / 1.5}
    assert cg.group_extra("proxy", (0.0, 0.0, 0), 1.0) == {
        "cpu_proxy": 0.0, "wait_proxy_ms_per_s": 0.0, "slices_proxy_per_s": 0.0}


def test_cpulists(cg):
    assert cg.parse_cpulist("0-2,5, 7-8") == {0, 1, 2, 5, 7, 8}
    assert cg.format_cpulist({8, 0, 1, 2, 5, 7}) == "0-2,5,7-8"
    for bad in ("", "a", "3-1", "1-", "-2", "1,,2"):
        with pytest.raises(ValueError):
            cg.parse_cpulist(bad)


def test_pins_parsed_and_sglang_covers_both_sglang_groups(cg):
    pins = cg.parse_pins(["sglang=0-5", "sglang_sched=6", "proxy=7,8", "clients=9-15"], set(range(16)))
    assert pins == {"sglang": {0, 1, 2, 3, 4, 5}, "sglang_sched": {6}, "proxy": {7, 8},
                    "clients": set(range(9, 16))}
    assert cg.pins_for(pins, "sglang_sched") == {6}
    assert cg.pins_for(pins, "sglang_other") == {0, 1, 2, 3, 4, 5}
    assert cg.pins_for({"proxy": {1}}, "clients") is None


@pytest.mark.parametrize(("spec", "message"), [
    ("scheduler=1", ("--pin scheduler=1: unknown group 'scheduler', use one of sglang, sglang_sched, sglang_other, "
                    "proxy, clients (e.g. --pin sglang=0-5 --pin proxy=6-9 --pin clients=10-15)")),
    ("proxy", "--pin proxy: expected GROUP=CPULIST, e.g. --pin sglang=0-5 --pin proxy=6-9 --pin clients=10-15"),
    ("proxy=x", ("--pin proxy=x: 'x' is not a CPU list, write it as 0-5,8 "
                "(e.g. --pin sglang=0-5 --pin proxy=6-9 --pin clients=10-15)")),
    ("clients=2-5", "--pin clients=2-5: CPU 4-5 is not available to this process, pick from 0-3"),
])
def test_pin_mistakes_in_one_line(cg, spec, message):
    with pytest.raises(ValueError) as err:
        cg.parse_pins([spec], {0, 1, 2, 3})
    assert str(err.value) == message


def test_sglang_found_by_its_port_and_its_scheduler_by_title(cg):
    # Stand-ins named as SGLang 0.5.17 names its processes: the main one (`python -m sglang.launch_server`,
    # which listens) and a child titled sglang::scheduler_TP0 (setproctitle).
    code = ("import socket, subprocess, sys, time\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
            "child = subprocess.Popen(['sglang::scheduler_TP0', '60'], executable='/bin/sleep')\n"
            "print(s.getsockname()[1], child.pid, flush=True)\n"
            "sys.stdin.read(); child.kill()\n")
    main = subprocess.Popen(["sglang.launch_server", "-c", code], executable=sys.executable,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port, child = map(int, main.stdout.readline().split())
        assert cg.port_owners(port) == {main.pid}
        assert cg.sglang_groups(port) == {"sglang_sched": [child], "sglang_other": [main.pid]}
    finally:
        main.stdin.close()
        main.wait(timeout=10)


def test_children_are_one_level_with_their_command_lines(cg):
    code = ("import subprocess, sys; child = subprocess.Popen(['/bin/sleep', '60'])\n"
            "print(child.pid, flush=True); sys.stdin.read(); child.kill()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(proc.stdout.readline())
        assert cg.children(proc.pid) == {grandchild: "/bin/sleep 60"}
        assert cg.children(os.getpid())[proc.pid] == f"{sys.executable} -c {code}"
        assert cg.descendants(proc.pid) == [grandchild]
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


def test_pin_sets_every_thread_of_a_process_and_restore_undoes_it(cg):
    cpu = min(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", ("import sys, threading\n"
                             "threading.Thread(target=sys.stdin.read).start(); print(flush=True); sys.stdin.read()")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tids) == 2
        before = cg.affinities([proc.pid])
        assert before == {t: os.sched_getaffinity(0) for t in tids}
        cg.pin([proc.pid], {cpu})
        assert [os.sched_getaffinity(t) for t in tids] == [{cpu}, {cpu}]
        cg.restore(before, [proc.pid])  # what the bench does to SGLang, which outlives it
        assert [os.sched_getaffinity(t) for t in tids] == [os.sched_getaffinity(0)] * 2
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
