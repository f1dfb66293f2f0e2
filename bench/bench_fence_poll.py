"""The fence's polling cost against its time to fence (issue 41 item 7), side by side.

N stub SGLang workers (one aiohttp app on N ports: /model_info with a weight version, pause / continue,
/update_weights_from_disk) and the proxy's real fence (token_proxy/fleet/fence.py) over the real admin
plane. For each N and each cadence:
- cost: /model_info reads a second that an idle fleet gets, over IDLE_S seconds;
- time to fence: one worker "restarts" (its version drops to "default"); seconds until the fence holds it,
  read by the poll alone, and with the data path's poke (a stale reply makes the fence read at once: what
  happens when the restarted worker's first reply comes back on other weights).
Cadences: `every-interval` (d6350dc: every worker every --fence-interval, 0.25 s) and `budget` (this branch:
the period stretched to N / READS_PER_S, the poke on a stale reply).

    PYTHONPATH=. .venv/bin/python bench/bench_fence_poll.py [--workers 16 64 256] [--idle 4] [--trials 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
import socket
import statistics
import time

from aiohttp import web

from token_proxy.fleet import fence as fence_module
from token_proxy.fleet.fence import Fence
from token_proxy.fleet.plane import AdminPlane
from token_proxy.settings import Settings
from token_proxy.sglang.client import SGLangClient, sglang_sessions


class Stubs:
    """N SGLang stand-ins in one app: each port's version and read count."""

    def __init__(self):
        self.version: dict[int, str] = {}
        self.reads = 0
        self.app = web.Application()
        self.app.router.add_get("/model_info", self.model_info)
        self.app.router.add_post("/{any:.*}", self.ok)

    def port(self, request: web.Request) -> int:
        return request.transport.get_extra_info("sockname")[1]

    async def model_info(self, request: web.Request) -> web.Response:
        self.reads += 1
        return web.json_response({"weight_version": self.version[self.port(request)], "model_path": "base"})

    async def ok(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        if request.path == "/update_weights_from_disk" and body.get("weight_version"):
            self.version[self.port(request)] = str(body["weight_version"])
        return web.json_response({"success": True, "message": "ok"})


def bound_sockets(n: int) -> list[socket.socket]:
    """N listening sockets on free ports (bound here: no other process can take a port meanwhile)."""
    socks = []
    for _ in range(n):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        socks.append(sock)
    return socks


async def one(n: int, cadence: str, idle_s: float, trials: int) -> dict:
    stubs = Stubs()
    runner = web.AppRunner(stubs.app, access_log=None)
    await runner.setup()
    ports = []
    for sock in bound_sockets(n):
        await web.SockSite(runner, sock).start()
        ports.append(sock.getsockname()[1])
        stubs.version[ports[-1]] = "7"
    urls = tuple(f"http://127.0.0.1:{p}" for p in ports)
    fence_module.READS_PER_S = math.inf if cadence == "every-interval" else 32.0
    out = {"workers": n, "cadence": cadence}
    async with sglang_sessions(30.0) as (pooled, _fresh):
        settings = Settings(backend_url=urls[0], workers=urls, fence_interval_s=0.25, admin_timeout_s=5.0)
        plane = AdminPlane(settings=settings, client=SGLangClient(urls[0], pooled, 30.0), base_model_path="base",
                           initial_version="7", version="7")
        plane.weights.loaded_path, plane.weights.checkpoint_proven = "/ckpt/7", True
        fence = Fence(plane, 0.25)
        task = asyncio.get_running_loop().create_task(fence.run())
        await asyncio.sleep(1.0)
        stubs.reads, started = 0, time.monotonic()
        await asyncio.sleep(idle_s)
        out["reads_per_s"] = stubs.reads / (time.monotonic() - started)
        for poke in (False, True):
            times = []
            for _ in range(trials):
                await asyncio.sleep(random.uniform(0, fence.period()))
                port = random.choice(ports[1:])
                stubs.version[port] = "default"
                url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
                if poke and cadence == "budget":
                    fence.poke()  # the restarted worker's first reply was stale
                while url not in fence.fenced:
                    await asyncio.sleep(0.005)
                times.append(time.monotonic() - t0)
                while url in fence.fenced:  # healed from /ckpt/7
                    await asyncio.sleep(0.01)
            out["fence_s_poke" if poke else "fence_s_poll"] = (statistics.median(times), max(times))
        task.cancel()
    await runner.cleanup()
    return out


async def main(args) -> None:
    logging.disable(logging.ERROR)  # the fence's own lines (fenced, healed) would drown the table
    print("| workers | cadence | reads/s asked (N / period) | /model_info reads/s measured (idle) | time to fence, poll only: median / max (s) | "
          "with the stale-reply poke: median / max (s) |")
    print("|---|---|---|---|---|---|")
    for n in args.workers:
        for cadence in ("every-interval", "budget"):
            r = await one(n, cadence, args.idle, args.trials)
            poke = "same as poll" if cadence == "every-interval" else "{:.2f} / {:.2f}".format(*r["fence_s_poke"])
            asked = n / 0.25 if cadence == "every-interval" else n / max(0.25, n / 32.0)
            print(f"| {n} | {cadence} | {asked:.0f} | {r['reads_per_s']:.0f} | {r['fence_s_poll'][0]:.2f} / "
                  f"{r['fence_s_poll'][1]:.2f} | {poke} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--idle", type=float, default=4.0)
    parser.add_argument("--trials", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
