"""Issue 37 item 3: the fleet's invariants hold after every step of random sequences (hypothesis's stateful
testing) on a simulator fleet of two SGLang workers, A (the data path's backend) and B.

Steps: disk transactions, NCCL pushes through the proxy (the simulator's stand-in group: tests/admin/
conftest.py's fake_group, neither NCCL nor gloo runs, so what is proved is the proxy's bookkeeping, not a
collective), failed pushes (B refuses bucket 2), a worker's weights reset behind the proxy's back (SGLang's
start state, as in finding 3), a worker killed and restarted, the controller restarted (its start rule over
workers that may disagree), a follower (--fleet-controller) and a second would-be controller.

After each step (once the fence has had a few polls), for the controller and the follower:
- LABELS: every worker's weight version is a label whose weights it holds (its weights checksum equals the
  one recorded when that label was made), or the fence's honest "?unproven:" label;
- PAUSED: a paused worker is in a held fleet or fenced, and then /weight_info and the gauge name it;
- REPLIES: a chat answers 200 on the fleet's version only, or, with no healthy worker, a 503 with
  Retry-After within BOUND_S;
and at the end the fleet converges: a disk update brings every worker in, nothing fenced, chats 200.
"""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.admin.conftest import fake_group  # noqa: F401 (the simulators' stand-in group)
from tests.admin.test_push_failure import BUCKETS, INIT
from tests.support.admin_fixtures import free_port
from token_proxy.app import create_app
from token_proxy.fleet import ADMIN, FENCE
from token_proxy.settings import Settings
from token_proxy.sglang.discovery import wait_until_connected
from token_proxy.simulator import SIM_STATE, SimConfig, create_sim_app
from token_proxy.simulator.rl_routes import RL_SIM

BOUND_S = 3.0  # a chat with no healthy worker answers a 503 within this
BASE = "sim/qwen2-tiny"
CHAT = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2, "temperature": 0}


class Loop:
    """An event loop in a thread: the state machine's rules are synchronous."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Fleet:
    """Two simulators, a controller proxy on a fixed port, maybe a follower; all on the loop's thread."""

    def __init__(self, tokenizer_dir, tmp_path):
        self.tokenizer_dir, self.tmp_path = str(tokenizer_dir), tmp_path
        self.sims: list[TestServer] = []
        self.controller: TestServer | None = None
        self.follower: TestServer | None = None
        self.port = free_port()
        self.session: aiohttp.ClientSession | None = None

    async def start(self):
        self.session = aiohttp.ClientSession()
        for _ in range(2):
            config = SimConfig(tokenizer_path=self.tokenizer_dir, enable_deterministic_inference=True, tpot_s=0.001)
            server = TestServer(create_sim_app(config), host="127.0.0.1")
            await server.start_server()
            self.sims.append(server)
        self.controller = await self.proxy(self.port)

    def urls(self) -> tuple[str, ...]:
        return tuple(str(s.make_url("")).rstrip("/") for s in self.sims)

    async def proxy(self, port: int, **overrides) -> TestServer:
        settings = Settings(backend_url=self.urls()[0], workers=self.urls(), tokenizer=self.tokenizer_dir,
                            fence_interval_s=0.05, admin_timeout_s=5.0, weight_update_timeout_s=5.0,
                            backend_wait_s=5.0, **overrides)
        app = create_app(settings)
        server = TestServer(app, host="127.0.0.1", port=port)
        await server.start_server()
        await wait_until_connected(app, 5.0)
        return server

    async def stop(self):
        for server in [self.follower, self.controller, *self.sims]:
            if server is not None:
                await server.close()
        await self.session.close()

    def url(self, server) -> str:
        return str(server.make_url("")).rstrip("/")

    async def call(self, server, method: str, path: str, timeout: float = 30.0, **kwargs):
        started = time.monotonic()
        async with self.session.request(method, self.url(server) + path, timeout=aiohttp.ClientTimeout(timeout),
                                        **kwargs) as response:
            try:
                body = await response.json(content_type=None)
            except ValueError:
                body = await response.text()
            return response.status, body, response.headers, time.monotonic() - started

    async def checksum(self, sim) -> str:
        status, body, _, _ = await self.call(sim, "POST", "/weights_checker", json={"action": "checksum"})
        assert status == 200, body
        return body["per_engine_checksum"]


class FleetMachine(RuleBasedStateMachine):
    loop: Loop  # set by the test, with the tokenizer and a directory for each run's checkpoints
    tokenizer_dir = tmp_root = None
    runs = 0

    def __init__(self):
        super().__init__()
        FleetMachine.runs += 1
        self.tmp_path = self.tmp_root / f"run_{self.runs}"
        self.tmp_path.mkdir()
        self.fleet = Fleet(self.tokenizer_dir, self.tmp_path)
        self.loop.run(self.fleet.start())
        self.steps = 0
        # label -> the weights checksum it names (what a worker holding that label must hold)
        self.truth = {"default": self.loop.run(self.fleet.checksum(self.fleet.sims[0]))}

    def run(self, coro, timeout: float = 60.0):
        return self.loop.run(coro, timeout)

    @property
    def plane(self):
        return self.fleet.controller.app[ADMIN]

    # ---- steps

    @rule()
    def disk_update(self):
        self.steps += 1
        path = self.tmp_path / f"step_{self.steps}"
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"\0")
        status, body, _, _ = self.run(self.fleet.call(self.fleet.controller, "POST", "/update_weights",
                                                       json={"weight_dir": str(path)}))
        if status == 200:
            self.truth[str(self.steps)] = self.run(self.fleet.checksum(self.fleet.sims[0]))
        else:  # a worker restarting mid-update: rolled back or held, never half-labelled
            assert status in (409, 502, 503), body

    @rule(fail=st.booleans())
    def nccl_push(self, fail):
        self.steps += 1
        label = f"n{self.steps}"
        controller, sims = self.fleet.controller, self.fleet.sims
        call = self.fleet.call
        if self.run(call(controller, "POST", "/pause"))[0] != 200:
            return
        self.run(call(controller, "POST", "/init_broadcaster", json=INIT))
        if fail:
            sims[1].app[RL_SIM].faults.extend([{"kind": "pass"}, {"kind": "partial", "message": "refuses"}])
        statuses = []
        for i, bucket in enumerate(BUCKETS):
            body = {**bucket, "flush_cache": False} if i < 2 else {**bucket, "weight_version": label}
            status = self.run(call(controller, "POST", "/update_weights_from_distributed", json=body))[0]
            statuses.append(status)
            if status != 200:
                break
        sims[1].app[RL_SIM].faults.clear()
        if statuses == [200, 200, 200]:
            self.truth[label] = self.run(self.fleet.checksum(sims[0]))
        self.run(call(controller, "POST", "/resume"))

    @rule(worker=st.sampled_from([0, 1]))
    def reset_behind_the_back(self, worker):
        """Straight to SGLang: the weights SGLang starts with, as finding 3's reset did."""
        sim = self.fleet.sims[worker]
        status, body, _, _ = self.run(self.fleet.call(sim, "POST", "/update_weights_from_disk",
                                                       json={"model_path": BASE, "weight_version": "default"}))
        assert status == 200, body

    @rule(worker=st.sampled_from([0, 1]))
    def kill_and_restart(self, worker):
        sim = self.fleet.sims[worker]
        assert self.run(self.fleet.call(sim, "POST", "/sim/restart", json={"restart_s": 0.2}))[0] == 200
        self.run(asyncio.sleep(0.3))

    @rule()
    def restart_controller(self):
        async def restart():
            await self.fleet.controller.close()
            self.fleet.controller = await self.fleet.proxy(self.fleet.port)
        self.run(restart())

    @precondition(lambda self: self.fleet.follower is None)
    @rule()
    def start_follower(self):
        controller = self.fleet.url(self.fleet.controller)
        self.fleet.follower = self.run(self.fleet.proxy(free_port(), fleet_controller=controller))

    @rule()
    def second_controller_stands_down(self):
        """A second proxy without --fleet-controller: once the controller updates, the two find out, one
        stands down (one line), and the workers' versions stop moving: they never take turns."""
        other = self.run(self.fleet.proxy(free_port()))
        try:
            self.disk_update()
            self.run(asyncio.sleep(0.5))
            seen = []
            for _ in range(8):
                seen.append(tuple(s.app[SIM_STATE].weight_version for s in self.fleet.sims))
                self.run(asyncio.sleep(0.1))
            assert len(set(seen)) == 1, f"the workers' versions keep moving: {seen}"
            down = [p.app[ADMIN].stood_down is not None for p in (self.fleet.controller, other)]
            assert down.count(True) <= 1, down
            fights = other.app[FENCE].events["fenced"] + self.fleet.controller.app[FENCE].events["fenced"]
            assert fights <= 4, fights  # one undo per worker and proxy at most, never an endless fight
        finally:
            self.run(other.close())

    # ---- invariants

    def settle(self):
        """The fence's polls and heals run; a heal or update in flight ends (bounded)."""
        async def wait():
            await asyncio.sleep(0.3)
            deadline = time.monotonic() + 5.0
            fence = self.fleet.controller.app[FENCE]
            while time.monotonic() < deadline and (self.plane.control.lock.locked()
                                                   or any(e.healing for e in fence.fenced.values())):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
        self.run(wait())

    @invariant()
    def invariants_hold(self):
        self.settle()
        self.run(self.check())

    async def check(self):
        fleet, plane = self.fleet, self.plane
        fence = fleet.controller.app[FENCE]
        status, info, _, _ = await fleet.call(fleet.controller, "GET", "/weight_info")
        assert status == 200, info
        listed = {f["url"] for f in info["fenced"]}
        _, metrics, _, _ = await fleet.call(fleet.controller, "GET", "/metrics")
        gauged = {url for url in fleet.urls() if 'token_proxy_fenced_workers{reason=' in metrics
                  and f'url="{url}"' in metrics}
        for sim, url in zip(fleet.sims, fleet.urls()):
            state = sim.app[SIM_STATE]
            label = state.weight_version
            held = "?unproven:" in label
            assert held or label in self.truth, f"{url} carries {label!r}, a label no update made"
            if not held:
                assert await fleet.checksum(sim) == self.truth[label], f"{url} is labelled {label!r} on other weights"
            if state.paused:
                assert plane.control.hold is not None or plane.control.paused or url in fence.fenced, f"{url} paused for nothing"
            if url in fence.fenced:
                assert url in listed and url in gauged, (url, info["fenced"])
        for proxy in [fleet.controller, fleet.follower]:
            if proxy is not None:
                await self.chat_ok(proxy)

    async def chat_ok(self, proxy):
        fleet, plane = self.fleet, self.plane
        status, body, headers, took = await fleet.call(proxy, "POST", "/v1/chat/completions", json=CHAT,
                                                       timeout=BOUND_S + 10)
        if status == 200:
            versions = {v["version"] for v in body["choices"][0].get("weight_versions") or []}
            assert versions <= {plane.weights.version}, (versions, plane.weights.version)
            return
        assert status == 503 and headers.get("Retry-After"), (status, body)
        assert took < BOUND_S, f"a 503 after {took:.1f} s"
        a = fleet.urls()[0]
        assert plane.control.hold is not None or a in fleet.controller.app[FENCE].fenced, body

    def teardown(self):
        try:
            self.settle()
            self.disk_update()  # the faults stop: the fleet converges
            self.settle()
            fence = self.fleet.controller.app[FENCE]
            self.run(asyncio.sleep(0.5))
            assert fence.fenced == {}, fence.info()
            assert {s.app[SIM_STATE].weight_version for s in self.fleet.sims} == {self.plane.weights.version}
            self.run(self.check())
        finally:
            self.run(self.fleet.stop())


@pytest.mark.usefixtures("fake_group")
def test_the_fleet_keeps_its_invariants(shared_tokenizer, tokenizer_dir, tmp_path):
    loop = Loop()
    FleetMachine.loop, FleetMachine.tokenizer_dir, FleetMachine.tmp_root = loop, tokenizer_dir, tmp_path
    try:
        run_state_machine_as_test(FleetMachine, settings=settings(
            max_examples=3, stateful_step_count=6, deadline=None, derandomize=True,
            suppress_health_check=list(HealthCheck)))
    finally:
        loop.close()
