"""Fleet-consistent weight updates behind one proxy URL (three simulated workers), with failure injection:
one worker refuses, one times out, one restarts mid-update, a rollback that fails (hold). Requests in flight
finish on one version or are aborted cleanly; none is lost or left hanging."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from tests.support.admin_fixtures import until
from token_proxy.admin import ADMIN
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.rl_routes import RL_SIM
from token_proxy.simulator.testing import parse_sse

LONG = {"messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": 40, "temperature": 0,
        "ignore_eos": True}
BASE = "sim/qwen2-tiny"


def state(server):
    return server.app[SIM_STATE]


def url_of(server) -> str:
    return str(server.make_url("")).rstrip("/")


def weights_dir(tmp_path, name: str) -> str:
    directory = tmp_path / name
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"\0")
    return str(directory)


def inject(server, *faults: dict) -> None:
    server.app[RL_SIM].faults.extend(faults)


async def rollout(proxy) -> dict:
    """One streamed chat request: how it ended, and which weight versions produced its tokens."""
    response = await proxy.post("/v1/chat/completions", data=orjson.dumps({**LONG, "stream": True}))
    if response.status != 200:
        return {"status": response.status, "error": await response.text()}
    events = parse_sse(await response.read())
    finals = [e for e in events[:-1] if isinstance(e, dict) and e.get("choices")
              and e["choices"][0].get("finish_reason")]
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if not finals:
        return {"status": 200, "error": errors[0]["error"] if errors else "stream ended without a finish"}
    choice = finals[-1]["choices"][0]
    return {"status": 200, "finish_reason": choice["finish_reason"],
            "versions": [v["version"] for v in choice.get("weight_versions") or []]}


@pytest.fixture
async def fleet3(make_sim, make_proxy):
    sims = [await make_sim(tpot_s=0.004) for _ in range(3)]

    async def proxy(**overrides):
        overrides.setdefault("admin_timeout_s", 5.0)
        overrides.setdefault("weight_update_timeout_s", 5.0)
        return await make_proxy(sims[0], workers=tuple(url_of(s) for s in sims), **overrides)

    return proxy, sims


async def in_flight(proxy, sim, count: int = 3) -> list[asyncio.Task]:
    tasks = [asyncio.create_task(rollout(proxy)) for _ in range(count)]
    await until(lambda: sum(len(s.output_ids) > 2 for s in state(sim).running.values()) == count)
    return tasks


async def test_a_fleet_update_pauses_updates_verifies_and_resumes(fleet3, tmp_path):
    make, sims = fleet3
    proxy = await make()
    tasks = await in_flight(proxy, sims[0])
    response = await proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1"),
                                                         "verify": "checksum"})
    assert (response.status, await response.json()) == (200, {"status": "ok", "weight_version": "1"})
    assert [state(s).weight_version for s in sims] == ["1", "1", "1"]
    assert not any(state(s).paused for s in sims)  # it paused them itself, so it resumed them
    for result in await asyncio.wait_for(asyncio.gather(*tasks), 20):
        assert result["finish_reason"] == "length" and result["versions"] == ["default", "1"]
    info = await (await proxy.get("/weight_info")).json()
    assert info["consistent"] and [w["weight_version"] for w in info["workers"]] == ["1", "1", "1"]


async def test_one_worker_refuses_and_the_others_roll_back(fleet3, tmp_path):
    make, sims = fleet3
    proxy = await make()
    inject(sims[1], {"kind": "fail", "message": "Failed to get weights iterator: disk full."})
    tasks = await in_flight(proxy, sims[0])
    response = await proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1")})
    body = await response.json()
    urls = [url_of(s) for s in sims]
    assert response.status == 400 and body["outcome"] == "rolled_back" and body["weight_version"] == "default"
    assert body["error"]["message"] == (
        f"update_weights failed on 1 of 3 worker(s): {urls[1]}: Failed to get weights iterator: disk full.; "
        "every worker rolled back to version default")
    assert [(w["url"], w["success"], w["weight_version"]) for w in body["workers"]] == [
        (urls[0], True, "default"), (urls[1], False, "default"), (urls[2], True, "default")]
    assert [(state(s).weight_version, state(s).weights_path) for s in sims] == [("default", BASE)] * 3
    assert not any(state(s).paused for s in sims)
    for result in await asyncio.wait_for(asyncio.gather(*tasks), 20):
        assert result == {"status": 200, "finish_reason": "length", "versions": ["default"]}  # one version


async def test_one_worker_times_out_and_is_rolled_back_after_its_late_update(fleet3, tmp_path):
    make, sims = fleet3
    proxy = await make(weight_update_timeout_s=2.0)  # wide margins: the other two must answer within it
    inject(sims[2], {"kind": "delay", "delay_s": 2.6})
    tasks = await in_flight(proxy, sims[0])
    response = await proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1")})
    body = await response.json()
    assert response.status == 504 and body["outcome"] == "rolled_back"
    assert [w["success"] for w in body["workers"]] == [True, True, False]
    await asyncio.sleep(1.0)  # nothing lands later: the late update came before the rollback
    assert [(state(s).weight_version, state(s).weights_path) for s in sims] == [("default", BASE)] * 3
    for result in await asyncio.wait_for(asyncio.gather(*tasks), 20):
        assert result == {"status": 200, "finish_reason": "length", "versions": ["default"]}


async def test_a_worker_restarting_mid_update_drops_its_requests_cleanly_and_the_fleet_rolls_back(fleet3, tmp_path):
    make, sims = fleet3
    proxy = await make()
    inject(sims[0], {"kind": "restart", "restart_s": 0.3})
    tasks = await in_flight(proxy, sims[0])
    survivors = [asyncio.create_task(rollout(proxy))]  # queued behind the pause on the same worker
    response = await proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1")})
    body = await response.json()
    # The update's connection was cut before any answer; being a reused one, it was sent once more on a
    # fresh connection (upstream/client.py: send), which the restarting worker answered 503.
    assert response.status == 502 and body["outcome"] == "rolled_back", body
    assert body["error"]["message"].startswith(f"update_weights failed on 1 of 3 worker(s): {url_of(sims[0])}: "
                                               "HTTP 503"), body
    assert sims[0].app[RL_SIM].restarts == 1
    assert [(state(s).weight_version, state(s).weights_path) for s in sims] == [("default", BASE)] * 3
    assert not any(state(s).paused for s in sims)
    results = await asyncio.wait_for(asyncio.gather(*tasks, *survivors), 20)
    for result in results[:3]:  # cut by the restart: an error event the client sees, never a hang
        assert result["status"] == 200 and result["error"]["code"] == 503
        assert result["error"]["message"].startswith("SGLang closed the connection mid-response")
    assert results[3]["status"] == 503  # the one queued behind the pause on that worker: a clean 503
    after = await rollout(proxy)
    assert after == {"status": 200, "finish_reason": "length", "versions": ["default"]}


async def test_a_failed_rollback_holds_every_worker_paused_until_one_version_is_everywhere(fleet3, tmp_path):
    make, sims = fleet3
    proxy = await make()
    inject(sims[1], {"kind": "pass"}, {"kind": "fail", "message": "Failed to load: out of memory."})
    inject(sims[2], {"kind": "fail", "message": "Failed to get weights iterator: disk full."})
    tasks = await in_flight(proxy, sims[0])
    response = await proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1")})
    body = await response.json()
    urls = [url_of(s) for s in sims]
    assert response.status == 400 and body["outcome"] == "held_paused" and body["weight_version"] is None
    assert body["error"]["message"].endswith(
        f"the rollback failed too: {urls[1]}: Failed to load: out of memory.; every worker stays paused "
        "(POST /resume?force=true to serve anyway)")
    assert [state(s).weight_version for s in sims] == ["default", "1", "default"]
    assert all(state(s).paused for s in sims)
    refused = await proxy.post("/resume")
    message = (await refused.json())["error"]["message"]
    assert refused.status == 409 and f"versions now: {urls[0]}: 'default', {urls[1]}: '1', {urls[2]}: 'default'" in message
    assert (await (await proxy.get("/weight_info")).json())["consistent"] is False
    assert not any(t.done() for t in tasks)  # held, not lost

    fixed = await proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_2")})
    assert (fixed.status, await fixed.json()) == (200, {"status": "ok", "weight_version": "2"})
    assert all(state(s).paused for s in sims)  # the hold paused them: the caller resumes
    assert await (await proxy.post("/resume")).json() == {"status": "resumed"}
    for result in await asyncio.wait_for(asyncio.gather(*tasks), 20):
        assert result["finish_reason"] == "length" and result["versions"] == ["default", "2"]


async def test_resume_can_be_forced_through_a_hold(fleet3, tmp_path):
    make, sims = fleet3
    proxy = await make()
    proxy.app[ADMIN].weights.loaded_path = None  # the fleet's weights came over NCCL: no checkpoint to go back to
    inject(sims[1], {"kind": "fail"})
    response = await proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1")})
    body = await response.json()
    assert response.status == 400 and body["outcome"] == "held_paused"
    assert [state(s).weight_version for s in sims] == ["1", "default", "1"]
    assert (await proxy.post("/resume")).status == 409
    refused = await proxy.post("/resume", params={"force": "maybe"})
    assert refused.status == 400 and (await refused.json())["error"]["param"] == "force"
    forced = await proxy.post("/resume", params={"force": "1"})  # the flag rule of every admin route
    assert (forced.status, await forced.json()) == (200, {"status": "resumed"})
    assert not any(state(s).paused for s in sims)


async def test_prime_rl_paused_fleet_stays_paused_for_its_own_resume(fleet3, tmp_path):
    make, sims = fleet3
    proxy = await make()
    assert await (await proxy.post("/pause")).json() == {"status": "paused"}
    inject(sims[2], {"kind": "fail"})
    response = await proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1")})
    assert response.status == 400 and (await response.json())["outcome"] == "rolled_back"
    assert all(state(s).paused for s in sims)  # prime-rl paused; prime-rl resumes (in its finally)
    assert await (await proxy.post("/resume")).json() == {"status": "resumed"}


async def test_concurrent_updates_run_one_after_the_other(fleet3, tmp_path):
    make, sims = fleet3
    proxy = await make()
    inject(sims[0], {"kind": "delay", "delay_s": 0.3})
    inject(sims[1], {"kind": "fail", "message": "Failed to get weights iterator: disk full."})
    first = asyncio.create_task(proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1")}))
    await until(lambda: all(state(s).paused for s in sims))
    second = await proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_2")})
    first = await first
    assert (first.status, (await first.json())["outcome"]) == (400, "rolled_back")
    assert (second.status, await second.json()) == (200, {"status": "ok", "weight_version": "2"})
    assert [state(s).weight_version for s in sims] == ["2", "2", "2"]  # the rollback undid only its own update
    assert not any(state(s).paused for s in sims)


async def test_resume_during_an_update_is_refused_and_the_pause_is_recorded(fleet3, tmp_path):
    make, sims = fleet3
    proxy = await make()
    inject(sims[2], {"kind": "delay", "delay_s": 0.4})
    update = asyncio.create_task(proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1")}))
    await until(lambda: all(state(s).paused for s in sims))
    assert await (await proxy.get("/is_paused")).json() == {"is_paused": True}
    refused = await proxy.post("/resume")
    assert refused.status == 409 and (await refused.json())["error"]["message"] == (
        "a weight update is in progress: it resumes the workers it paused when it ends")
    assert all(state(s).paused for s in sims)  # still paused: no worker serves a mixed fleet
    response = await update
    assert (response.status, await response.json()) == (200, {"status": "ok", "weight_version": "1"})
    assert not any(state(s).paused for s in sims)
    assert await (await proxy.get("/is_paused")).json() == {"is_paused": False}


async def test_a_worker_that_does_not_resume_after_an_update_is_named(fleet3, tmp_path):
    make, sims = fleet3
    proxy = await make()
    inject(sims[2], {"kind": "fail", "path": "/continue_generation", "message": "Scheduler is busy."})
    response = await proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1")})
    assert response.status == 400 and (await response.json())["error"]["message"] == (
        f"update_weights landed on every worker (version 1), but resume failed on 1 of 3 worker(s): "
        f"{url_of(sims[2])}: Scheduler is busy.")
    assert [state(s).weight_version for s in sims] == ["1", "1", "1"]
    assert [state(s).paused for s in sims] == [False, False, True]
    assert await (await proxy.get("/is_paused")).json() == {"is_paused": True}  # so /resume is sent again
    assert await (await proxy.post("/resume")).json() == {"status": "resumed"}
    assert not any(state(s).paused for s in sims)
