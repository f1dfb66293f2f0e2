"""No rollout is served on weights other than the fleet's (issue 28, point 5): a worker that restarts (or
drifts to another version) is fenced (paused, out of the real sglang-router's list, named in /weight_info
and the metrics), healed from disk or held until the next NCCL push, and let back in; meanwhile a reply on
another version is sent again, never returned."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

import aiohttp
import orjson
import pytest

from tests.admin.test_fleet import state, url_of, weights_dir
from tests.sglang.test_router import wait_for_workers
from tests.support.admin_fixtures import free_port, stop_process, until
from token_proxy.admin import ADMIN
from token_proxy.fleet import FENCE, VersionRecord
from token_proxy.simulator import params
from token_proxy.simulator.rl_routes import RL_SIM
from token_proxy.simulator.testing import parse_sse

pytest.importorskip("sglang_router")

CHAT = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


async def restart(server, restart_s: float = 0.3) -> None:
    """The simulator dies and comes back `restart_s` later on the weights and version it started with."""
    async with aiohttp.ClientSession() as session, session.post(
            url_of(server) + "/sim/restart", json={"restart_s": restart_s}) as response:
        assert response.status == 200


async def router_urls(router: str) -> list[str]:
    async with aiohttp.ClientSession() as session, session.get(router + "/workers") as response:
        return sorted(w["url"] for w in (await response.json())["workers"])


async def rollout(proxy, stream: bool) -> dict:
    """One chat rollout: its status and the weight versions of its tokens (vLLM's weight_versions)."""
    response = await proxy.post("/v1/chat/completions", data=orjson.dumps({**CHAT, "stream": stream}))
    if response.status != 200:
        return {"status": response.status, "error": await response.text()}
    if not stream:
        choice = (await response.json())["choices"][0]
    else:
        events = parse_sse(await response.read())
        finals = [e for e in events[:-1] if isinstance(e, dict) and e.get("choices")
                  and e["choices"][0].get("finish_reason")]
        if not finals:
            return {"status": 200, "error": events}
        choice = finals[-1]["choices"][0]
    return {"status": 200, "versions": sorted({v["version"] for v in choice.get("weight_versions") or []})}


class Load:
    """Rollouts (streamed and not, in turn) through the proxy until stopped."""

    def __init__(self, proxy, concurrency: int = 4):
        self.results: list[dict] = []
        self.stopped = False
        self.tasks = [asyncio.create_task(self._loop(proxy, i % 2 == 1)) for i in range(concurrency)]

    async def _loop(self, proxy, stream: bool) -> None:
        while not self.stopped:
            self.results.append(await rollout(proxy, stream))

    async def stop(self) -> list[dict]:
        self.stopped = True
        await asyncio.wait_for(asyncio.gather(*self.tasks), 30)
        return self.results


async def metric_lines(proxy, prefix: str) -> list[str]:
    text = await (await proxy.get("/metrics")).text()
    return sorted(line for line in text.splitlines() if line.startswith(prefix))


@pytest.fixture
async def routed(make_sim, tokenizer_dir):
    """Two simulators behind the real sglang-router (round robin), its metrics exporter on a free port (its
    default, 29000, is taken by any other router on the host). Started again on other ports if it exits
    at start (a port another process took between free_port() and its bind)."""
    sims = [await make_sim(tpot_s=0.002), await make_sim(tpot_s=0.002)]
    urls = [url_of(s) for s in sims]
    for attempt in range(3):
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *urls, "--policy", "round_robin", "--tokenizer-path", str(tokenizer_dir),
               "--log-level", "warn", "--prometheus-port", str(free_port())]
        process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: ASYNC220
        try:
            await wait_for_workers(f"http://127.0.0.1:{port}", 2, process)
            break
        except AssertionError:
            stop_process(process)
            if attempt == 2:
                raise
    try:
        yield f"http://127.0.0.1:{port}", sims, urls
    finally:
        stop_process(process)


async def test_a_restarted_worker_is_fenced_healed_from_disk_and_let_back_in(routed, make_proxy, tmp_path):
    router, sims, urls = routed
    proxy = await make_proxy(router, context_length=4096, fence_interval_s=0.05, admin_timeout_s=5.0,
                             weight_update_timeout_s=10.0)
    step = weights_dir(tmp_path, "step_7")
    response = await proxy.post("/update_weights", json={"weight_dir": step, "verify": "checksum"})
    assert (response.status, await response.json()) == (200, {"status": "ok", "weight_version": "7"})
    assert [state(s).weight_version for s in sims] == ["7", "7"]

    before = Load(proxy)
    await until(lambda: len(before.results) >= 8, timeout=10)
    assert [r for r in await before.stop() if r != {"status": 200, "versions": ["7"]}] == []
    # Killed and started again (what was in flight on it is cut: fleet.py's docstring); rollouts go on
    # through its death, its return on "default", the fence, the heal and its way back in.
    sims[1].app[RL_SIM].faults.append({"kind": "delay", "delay_s": 1.5})  # the heal's reload: time to look
    await restart(sims[1])
    load = Load(proxy)
    fence = proxy.app[FENCE]
    await until(lambda: urls[1] in fence.fenced and fence.fenced[urls[1]].healing, timeout=10)

    # Fenced: paused, out of the router's list, named in /weight_info and the metrics.
    assert state(sims[1]).weight_version == "default"  # it restarted on the weights it started with
    assert state(sims[1]).paused is True and state(sims[1]).pause_mode == "abort"
    assert await router_urls(router) == [urls[0]]
    info = await (await proxy.get("/weight_info")).json()
    assert [(f["url"], f["removed_from_router"], f["healing"]) for f in info["fenced"]] == [(urls[1], True, True)]
    reason = info["fenced"][0]["reason"]
    assert reason.startswith("restarted (was unreachable: ") and reason.endswith("reports weight version 'default'")
    assert await metric_lines(proxy, "token_proxy_fenced_workers{") == [
        f'token_proxy_fenced_workers{{reason="{reason}",url="{urls[1]}"}} 1.0']

    # Healed from the fleet's checkpoint (version and checksum verified), and let back in.
    await until(lambda: not fence.fenced, timeout=15)
    assert [(state(s).weight_version, state(s).weights_path) for s in sims] == [("7", step), ("7", step)]
    assert state(sims[1]).paused is False
    assert await router_urls(router) == sorted(urls)
    assert (await (await proxy.get("/weight_info")).json())["fenced"] == []
    assert await metric_lines(proxy, "token_proxy_fence_events_total") == [
        'token_proxy_fence_events_total{event="fenced"} 1.0', 'token_proxy_fence_events_total{event="healed"} 1.0']
    assert await metric_lines(proxy, "token_proxy_fenced_workers{") == []
    await until(lambda: len(state(sims[1]).received) >= 4, timeout=10)  # it serves again

    results = await load.stop()
    assert len(results) >= 16
    assert [r for r in results if r != {"status": 200, "versions": ["7"]}] == []  # 0 lost, 0 served stale
    print(f"rollouts during the restart: {len(results)} sent, all 200 on version 7; sent again "
          f"(last line): {await metric_lines(proxy, 'token_proxy_stale_replies_total{')}")


async def test_over_nccl_a_restarted_worker_stays_fenced_until_the_next_push(make_sim, make_proxy, fake_group):
    sims = [await make_sim(), await make_sim()]
    urls = [url_of(s) for s in sims]
    proxy = await make_proxy(sims[0], workers=tuple(urls), fence_interval_s=0.05, admin_timeout_s=5.0)
    names = list(params.PARAM_SHAPES)

    async def push(version: str) -> None:
        init = await proxy.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 3,
            "group_name": f"g{version}"})
        assert init.status == 200, await init.text()
        update = await proxy.post("/update_weights_from_distributed", json={
            "names": names, "dtypes": ["bfloat16"] * len(names), "group_name": f"g{version}",
            "shapes": [list(s) for s in params.PARAM_SHAPES.values()], "weight_version": version})
        assert update.status == 200, await update.text()

    await push("1")
    plane = proxy.app[ADMIN]
    assert (plane.weights.version, plane.weights.loaded_path) == ("1", None)  # the fleet's weights came over NCCL
    fence = proxy.app[FENCE]
    await restart(sims[1], restart_s=0.1)
    await until(lambda: urls[1] in fence.fenced and fence.fenced[urls[1]].came_back, timeout=10)
    await asyncio.sleep(0.5)  # no checkpoint holds version 1: it stays out, paused
    assert urls[1] in fence.fenced and state(sims[1]).weight_version == "default"
    assert state(sims[1]).paused is True
    info = await (await proxy.get("/weight_info")).json()
    assert [(f["url"], f["reason"].endswith("reports weight version 'default'")) for f in info["fenced"]] == [
        (urls[1], True)]
    assert (info["consistent"], [w["weight_version"] for w in info["workers"]]) == (False, ["1", "default"])

    await push("2")  # the trainer's next init and full push reach the fenced worker too
    await until(lambda: not fence.fenced, timeout=10)
    assert [(state(s).weight_version, state(s).paused) for s in sims] == [("2", False), ("2", False)]
    assert (await (await proxy.get("/weight_info")).json())["fenced"] == []
    assert await metric_lines(proxy, "token_proxy_fence_events_total") == [
        'token_proxy_fence_events_total{event="fenced"} 1.0', 'token_proxy_fence_events_total{event="healed"} 1.0']


async def test_a_reply_on_another_version_is_sent_again_never_returned(routed, make_proxy):
    router, sims, _ = routed
    proxy = await make_proxy(router, context_length=4096, fence_interval_s=0)  # the last line alone
    state(sims[1]).weight_version = "rogue"  # forced behind the proxy's back; the fleet serves "default"
    results = [await rollout(proxy, stream=i % 2 == 1) for i in range(12)]
    assert results == [{"status": 200, "versions": ["default"]}] * 12
    stale = len(state(sims[1]).received)  # round robin: every request B answered was sent again
    assert stale >= 4
    lines = await metric_lines(proxy, "token_proxy_stale_replies_total{")
    assert 'token_proxy_stale_replies_total{endpoint="/v1/chat/completions"} ' + f"{float(stale)}" in lines


async def test_a_worker_only_on_another_version_gives_a_503_after_the_tries(make_sim, make_proxy):
    sim = await make_sim()
    proxy = await make_proxy(sim, fence_interval_s=0, stale_reply_tries=3)
    await until(lambda: proxy.app[ADMIN].weights.version == "default")
    state(sim).weight_version = "rogue"
    for stream in (False, True):
        response = await proxy.post("/v1/chat/completions", data=orjson.dumps({**CHAT, "stream": stream}))
        body = await response.json()
        assert (response.status, body["error"]["message"]) == (503, (
            "SGLang answered from weight version 'rogue' while the fleet serves 'default', 3 time(s): a worker "
            "is out of step with the fleet (GET /weight_info names it)"))
    assert len(state(sim).received) == 6
    assert 'token_proxy_stale_replies_total{endpoint="/v1/chat/completions"} 6.0' in await metric_lines(
        proxy, "token_proxy_stale_replies_total{")


async def test_a_reply_kept_across_an_update_carries_a_version_the_fleet_held(make_sim, make_proxy, tmp_path):
    """The accepted set is every version the fleet held from the request's send to its reply: a rollout
    sent on "default", paused (keep) across an update to 1 and finished on 1 is returned, unretried."""
    sim = await make_sim(tpot_s=0.01)
    proxy = await make_proxy(sim, fence_interval_s=0.05)
    task = asyncio.create_task(rollout(proxy, stream=False))
    await until(lambda: any(len(s.output_ids) >= 1 for s in state(sim).running.values()))
    assert (await proxy.post("/pause")).status == 200
    response = await proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1")})
    assert response.status == 200
    assert (await proxy.post("/resume")).status == 200
    assert await asyncio.wait_for(task, 10) == {"status": 200, "versions": ["1"]}
    assert len(state(sim).received) == 1
    assert proxy.app[FENCE].fenced == {}


def test_the_accepted_set_is_what_the_fleet_held_from_send_to_reply_plus_updates_in_flight():
    record = VersionRecord("7", "default", [(10.0, "6"), (20.0, "7")], {"8": math.inf, "9": 25.0})
    assert record.accepted(since=5.0, now=30.0) == {"default", "6", "7", "8"}  # sent on default
    assert record.accepted(since=15.0, now=24.0) == {"6", "7", "8", "9"}  # sent on 6; 9 until 25
    assert record.accepted(since=21.0, now=30.0) == {"7", "8"}  # a restarted worker's "default": stale
    assert VersionRecord().accepted(since=0.0) is None  # no fleet version known: nothing is judged
    wire = orjson.loads(orjson.dumps(record.as_dict()))  # the --workers mirror's copy
    assert wire["incoming"] == {"8": None, "9": 25.0}
    assert VersionRecord.of(wire) == record
