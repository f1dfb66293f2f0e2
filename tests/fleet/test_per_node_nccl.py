"""One weight-update group spanning three proxies, one per inference node (issue 37 item 4): the trainer is
rank 0, proxy i's two workers are ranks 1 + 2i and 2 + 2i, world size 7; prime-rl's orchestrator fans
/init_broadcaster (rank_offset i * 2), /pause, /update_weights null and /resume out to the three proxies
(tests/support/prime_rl_admin.py), and the trainer's broadcaster announces every bucket to all three
(SGLangBroadcaster with a list of URLs). Each simulator joins with torch.distributed and receives for real.

gloo on CPU is a FALLBACK: it proves the ranks, the rendezvous, the fan-out and that every worker loads the
exact values, not the NCCL transport (tests/e2e/fleet_round.sh's GPU round runs NCCL). Needs torch (.ci/run
step 2)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading

import aiohttp
import pytest

torch = pytest.importorskip("torch")

from tests.admin.test_broadcast import new_weights
from tests.support.admin_fixtures import free_port, proxy_url, stop_process
from tests.support.prime_rl_admin import PrimeRLAdmin
from token_proxy.broadcast import SGLangBroadcaster

NODES, PER_NODE = 3, 2
WORLD = 1 + NODES * PER_NODE


class SimProcess:
    """`python -m token_proxy.simulator` on a free port, its JSON log lines kept (its group joins)."""

    def __init__(self, tokenizer_dir):
        cmd = [sys.executable, "-m", "token_proxy.simulator", "--port", "0", "--tokenizer", str(tokenizer_dir),
               "--dist-timeout", "60", "--log-format", "json"]
        self.process = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stderr:
            try:
                message = json.loads(line)["message"]
            except (ValueError, KeyError, TypeError):
                message = line.rstrip()  # a library's own line (a warning) on stderr
            self.lines.append(message)
            if message.startswith("SGLang simulator ready on "):
                self.url = message.split(" on ", 1)[1].strip()
                self.ready.set()

    def joins(self) -> list[str]:
        return [line for line in self.lines if line.startswith("init custom process group")]


@pytest.fixture
def node_sims(tokenizer_dir):
    """NODES x PER_NODE simulator processes, started together (each takes a second or two)."""
    sims = [[SimProcess(tokenizer_dir) for _ in range(PER_NODE)] for _ in range(NODES)]
    try:
        for sim in (s for node in sims for s in node):
            assert sim.ready.wait(120), f"a simulator did not start: {sim.lines[-5:]}"
        yield sims
    finally:
        for sim in (s for node in sims for s in node):
            stop_process(sim.process)


async def param(session: aiohttp.ClientSession, url: str, name: str) -> list:
    async with session.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 100000}) as reply:
        assert reply.status == 200
        return await reply.json()


async def test_one_push_lands_the_exact_values_on_every_worker_of_every_node(make_proxy, node_sims):
    proxies = [await make_proxy(node[0].url, workers=tuple(s.url for s in node), admin_timeout_s=20.0,
                                weight_update_timeout_s=20.0, init_group_timeout_s=60.0) for node in node_sims]
    urls = [proxy_url(p) for p in proxies]
    port = free_port()
    trainer = SGLangBroadcaster(url=urls, master_address="127.0.0.1", master_port=port,
                                inference_world_size=NODES * PER_NODE, backend="gloo", timeout_s=60.0)
    async with aiohttp.ClientSession() as session:
        orchestrator = PrimeRLAdmin(session, [u + "/v1" for u in urls], backoff_s=0.01)
        joined = asyncio.create_task(asyncio.to_thread(trainer.init, False))  # prime-rl's orchestrator announces
        statuses = await orchestrator.init_nccl_broadcast("127.0.0.1", port, 60, NODES * PER_NODE,
                                                           extra={"backend": "gloo"})
        assert statuses == [200] * NODES
        await asyncio.wait_for(joined, 90)
        for i, node in enumerate(node_sims):
            for j, sim in enumerate(node):
                [line] = sim.joins()
                assert f"master_port={port}, rank={1 + i * PER_NODE + j}, world_size={WORLD}," in line, line
                assert "backend=gloo" in line

        weights = new_weights(step=7)
        pushed = asyncio.create_task(asyncio.to_thread(trainer.update, weights.items(), "7"))
        # prime-rl's step: /pause, /update_weights null on every proxy while the trainer pushes, /resume
        await asyncio.wait_for(orchestrator.update_weights(None), 60)
        assert await asyncio.wait_for(pushed, 30) == 1  # one bucket, announced to the three proxies
        for proxy, node in zip(proxies, node_sims):
            info = await (await proxy.get("/weight_info")).json()
            assert (info["weight_version"], info["consistent"], info["fenced"]) == ("7", True, [])
            for sim in node:  # every worker of every node, read directly: the exact values
                for name in ("lm_head.weight", "model.norm.weight"):
                    assert await param(session, sim.url, name) == weights[name].float().tolist()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(trainer.close, False)
        for proxy in proxies:
            response = await proxy.post("/destroy_weights_update_group", json={"group_name": "weight_update_group"})
            assert response.status == 200

