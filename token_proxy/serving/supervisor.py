"""`token-proxy --workers N` (N > 1): the supervisor process. It serves no client itself: it runs the
admin owner on a Unix socket, starts N serving processes on the shared port and stops them (see __init__.py).

A serving process that dies (killed, crashed) is started again at once, in its place: its siblings go on
serving, so only the requests it held are cut (their clients see the connection reset, at once). The
new one joins the port only once it can serve (process.py), so no client meets its start-up 503s.
More than RESTARTS_PER_MINUTE deaths in a minute is a crash loop: the proxy stops.

Exit status: 0 after SIGTERM / SIGINT (every serving process drained); 2 for a configuration error found
while connecting (an unloadable tokenizer); 1 when serving processes keep dying (the others are stopped:
restart the whole proxy, as a process supervisor would).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from token_proxy.settings import Settings

log = logging.getLogger("token_proxy")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
KILL_GRACE_S = 10.0  # after the drain deadline, before a serving process is killed
RESTARTS_PER_MINUTE = 5  # serving process deaths tolerated (each restarted) before the proxy stops


def serve_processes(settings: Settings) -> int:
    """Blocks until the proxy stops; returns the exit status."""
    if os.environ.pop(MULTIPROC_ENV, None):  # the supervisor keeps its metrics in memory
        log.warning("%s is ignored: --workers uses a fresh directory of its own", MULTIPROC_ENV)
    run_dir = Path(tempfile.mkdtemp(prefix=f"token-proxy-{os.getpid()}-"))
    try:
        (run_dir / "metrics").mkdir()
        (run_dir / "settings.pickle").write_bytes(pickle.dumps(settings))
        return asyncio.run(_supervise(settings, run_dir))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


async def _supervise(settings: Settings, run_dir: Path) -> int:
    import gc

    from aiohttp import web
    from prometheus_client import multiprocess

    from token_proxy.app import create_app
    from token_proxy.ops.access_log import ACCESS_LOGGER
    from token_proxy.ops.drain import SERVER_GRACE_S
    from token_proxy.role import OWNER, Role
    from token_proxy.serving.metrics_block import PROCESSES
    from token_proxy.serving.process import RESTARTED_ENV
    from token_proxy.serving.serve import add_owner_planes
    from token_proxy.state import ON_FATAL

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The serving processes write the access lines; the owner's requests are theirs, forwarded (no second line).
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.WARNING)
    gc.freeze()
    control = run_dir / "control.sock"
    app = create_app(settings, Role(OWNER, control_socket=str(control)), add_owner_planes)
    fatal: list[str] = []

    def on_fatal(message: str) -> None:
        fatal.append(message)
        stop.set()

    app[ON_FATAL] = on_fatal
    processes: list = []  # by index; _watch replaces a dead one in place (the metrics block reads their pids)
    app[PROCESSES] = processes  # before the app starts: its state is frozen then
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=settings.shutdown_timeout_s + SERVER_GRACE_S)
    await runner.setup()
    await web.UnixSite(runner, str(control)).start()
    env = {**os.environ, MULTIPROC_ENV: str(run_dir / "metrics")}

    async def start(index: int, restarted: bool = False):
        # Started again (its siblings serve): it listens only once it can serve (process.py).
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "token_proxy.serving.process", str(run_dir), str(index),
            env={**env, RESTARTED_ENV: "1" if restarted else "0"}, stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True)

    processes.extend([await start(index) for index in range(settings.api_workers)])
    log.info("token-proxy: %d serving processes on http://%s:%d/v1 (pids %s), admin plane in pid %d -> %s",
             len(processes), settings.host, settings.port, ", ".join(str(proc.pid) for proc in processes),
             os.getpid(), settings.backend_url)
    status = await _watch(processes, start, stop, run_dir)
    status = 2 if fatal else status
    await _stop_processes(processes, settings.shutdown_timeout_s + KILL_GRACE_S)
    for proc in processes:
        multiprocess.mark_process_dead(proc.pid, str(run_dir / "metrics"))
    await runner.cleanup()
    return status


async def _watch(processes: list, start, stop: asyncio.Event, run_dir: Path) -> int:
    """Until `stop`: a serving process that exits is started again in its place (same index); the exit status
    when serving processes keep dying, or one exits 2 (a configuration error: a new one would fail the same)."""
    from prometheus_client import multiprocess

    loop = asyncio.get_running_loop()
    deaths: list[float] = []
    exits = {asyncio.ensure_future(proc.wait()): index for index, proc in enumerate(processes)}
    stopping = asyncio.ensure_future(stop.wait())
    try:
        while True:
            done, _ = await asyncio.wait([stopping, *exits], return_when=asyncio.FIRST_COMPLETED)
            if stopping in done:
                return 0
            for task in [task for task in done if task in exits]:
                index = exits.pop(task)
                proc = processes[index]
                now = loop.time()
                deaths[:] = [t for t in deaths if now - t < 60.0] + [now]
                if proc.returncode == 2 or len(deaths) > RESTARTS_PER_MINUTE:
                    why = "a configuration error" if proc.returncode == 2 else "serving processes keep dying"
                    log.error("worker %d (pid %d) exited with status %s (%s): stopping the proxy", index,
                              proc.pid, proc.returncode, why)
                    return 2 if proc.returncode == 2 else 1
                multiprocess.mark_process_dead(proc.pid, str(run_dir / "metrics"))
                processes[index] = await start(index, restarted=True)
                log.error("worker %d (pid %d) exited with status %s: started again as pid %d (its requests "
                          "in flight were cut)", index, proc.pid, proc.returncode, processes[index].pid)
                exits[asyncio.ensure_future(processes[index].wait())] = index
    finally:
        stopping.cancel()
        for task in exits:
            task.cancel()


async def _stop_processes(processes, deadline_s: float) -> None:
    """SIGTERM to each: it stops accepting and drains its requests (--shutdown-timeout); killed past
    the deadline."""
    for proc in processes:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.gather(*(proc.wait() for proc in processes)), deadline_s)
    except asyncio.TimeoutError:
        for proc in processes:
            if proc.returncode is None:
                log.error("worker pid %d did not stop within %.0f s: killed", proc.pid, deadline_s)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        await asyncio.gather(*(proc.wait() for proc in processes))
