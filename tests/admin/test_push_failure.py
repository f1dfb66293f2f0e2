"""A failed or abandoned NCCL push leaves nothing behind, in every dialect (issue 28, items 3, 6, 7, 8 and 5):
the group is destroyed on every worker (the same name joins again), partial weights hold the fleet (paused,
/weight_info inconsistent, /resume 409) until a complete push, the status says what to do (503: join again and
push again), one worker's refusal ends the fan-out at once, a step answers only for a push it waited for, and
vLLM's /finish_weight_update keeps the rollouts a /pause?mode=keep kept.

These run on CPU with two simulators whose groups are joined without torch (tests/admin/conftest.py's
fake_group stands in for gloo; NCCL is not used): what is exercised is the proxy's fan-out and bookkeeping and
the simulator's SGLang 0.5.17 replies, not the collective itself (tests/admin/test_broadcast.py receives over
gloo where torch is installed)."""

from __future__ import annotations

import asyncio
import time

import pytest

from token_proxy.admin import ADMIN
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.rl_routes import RL_SIM
from token_proxy.simulator.weight_routes import WEIGHTS

INIT = {"host": "127.0.0.1", "port": 29541, "timeout": 10, "rank_offset": 0, "inference_world_size": 2}
BUCKETS = [
    {"names": ["model.embed_tokens.weight"], "dtypes": ["bfloat16"], "shapes": [[32, 8]]},
    {"names": ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"],
     "dtypes": ["bfloat16", "bfloat16"], "shapes": [[8, 8], [8, 16]]},
    {"names": ["model.norm.weight", "lm_head.weight"], "dtypes": ["bfloat16", "bfloat16"], "shapes": [[8], [32, 8]]},
]
PARTIAL = ("Failed to update parameter online: refuses bucket 2. The full weights of the ModelRunner are partially "
           "updated. Please discard the whole weights.")
DESTROYED = ("the weight-update group 'weight_update_group' was destroyed on every worker: join again (the same "
             "name works) and push again")
LONG = {"messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": 40, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}


def url_of(server) -> str:
    return str(server.make_url("")).rstrip("/")


async def call(proxy, method: str, path: str, **kwargs) -> tuple[int, dict]:
    response = await proxy.request(method, path, **kwargs)
    return response.status, await response.json()


async def push(proxy, version: str) -> list[tuple[int, dict]]:
    """The trainer's three buckets through SGLang's own route; the last carries the weight version."""
    out = []
    for i, bucket in enumerate(BUCKETS):
        body = {**bucket, "flush_cache": False} if i < 2 else {**bucket, "weight_version": version}
        out.append(await call(proxy, "POST", "/update_weights_from_distributed", json=body))
    return out


def new(sim, name: str) -> bool:
    """The tensor came over the (stand-in) group, not the weights the simulator started with."""
    return not isinstance(sim.app[WEIGHTS].values[name], list)


@pytest.fixture
async def fleet2(make_sim, make_proxy):
    sims = [await make_sim() for _ in range(2)]
    proxy = await make_proxy(sims[0], workers=tuple(url_of(s) for s in sims), admin_timeout_s=5.0)
    proxy.app[ADMIN].weights.loaded_path = None  # the weights came over NCCL: nothing on disk to roll back to
    return proxy, sims


async def test_worker_b_refusing_bucket_2_of_3_holds_the_fleet_until_a_full_push(fleet2, fake_group):
    """Issue 28 item 6, call by call (prime-rl's dialect; the trainer pushes through SGLang's route)."""
    proxy, (a, b) = fleet2
    assert await call(proxy, "POST", "/init_broadcaster", json=INIT) == (200, {"status": "ok"})
    assert await call(proxy, "POST", "/pause") == (200, {"status": "paused"})
    b.app[RL_SIM].faults.extend([{"kind": "pass"}, {"kind": "partial", "message": "refuses bucket 2"}])
    first, second = await call(proxy, "POST", "/update_weights_from_distributed", json=BUCKETS[0]), None
    assert first[0] == 200
    status, second = await call(proxy, "POST", "/update_weights_from_distributed", json=BUCKETS[1])
    assert (status, second["success"], second["outcome"]) == (503, False, "held_paused")
    assert f"{url_of(b)}: {PARTIAL}" in second["message"] and DESTROYED in second["message"]
    # What the push left: B holds one new tensor of bucket 2 and the old other; no group anywhere.
    assert [new(b, name) for name in BUCKETS[1]["names"]] == [True, False]
    assert [s.app[WEIGHTS].groups for s in (a, b)] == [{}, {}]

    status, step = await call(proxy, "POST", "/update_weights", json={"weight_dir": None})
    assert (status, step["error"]["code"], step["error"]["type"]) == (503, 503, "AdminCallFailed")
    assert step["error"]["message"].startswith("update_weights (NCCL) failed: /update_weights_from_distributed "
                                               "failed on ")
    assert f"{url_of(b)}: {PARTIAL}" in step["error"]["message"]
    status, info = await call(proxy, "GET", "/weight_info")
    assert (status, info["weight_version"], info["consistent"]) == (200, None, False)
    assert info["workers"] == [{"url": url_of(a), "weight_version": "default", "partial": True},
                               {"url": url_of(b), "weight_version": "default", "partial": True}]
    assert info["held"] == second["message"].removesuffix(
        "; every worker stays paused (POST /resume?force=true to serve anyway)")
    status, resume = await call(proxy, "POST", "/resume")
    assert (status, resume["error"]["type"]) == (409, "ConflictError")
    status, finish = await call(proxy, "POST", "/finish_weight_update", json={"weight_version": "2"})
    assert status == 409 and finish["error"]["message"].startswith(
        "finish_weight_update: the workers are held paused after a failed weight update")
    assert [s.app[SIM_STATE].weight_version for s in (a, b)] == ["default", "default"]
    assert all(s.app[SIM_STATE].paused for s in (a, b))

    # The trainer joins again with the same group name and pushes everything: the hold ends.
    assert await call(proxy, "POST", "/init_broadcaster", json=INIT) == (200, {"status": "ok"})
    assert [status for status, _ in await push(proxy, "2")] == [200, 200, 200]
    assert await call(proxy, "POST", "/update_weights", json={"weight_dir": None}) == (
        200, {"status": "ok", "weight_version": "2"})
    status, info = await call(proxy, "GET", "/weight_info")
    assert (info["weight_version"], info["consistent"], "held" in info) == ("2", True, False)
    assert all(new(s, name) for s in (a, b) for bucket in BUCKETS for name in bucket["names"])
    assert await call(proxy, "POST", "/resume") == (200, {"status": "resumed"})
    assert not any(s.app[SIM_STATE].paused for s in (a, b))


async def test_a_workers_refusal_ends_the_fan_out_at_once(fleet2, fake_group):
    """Item 8: B refuses at once while A's receive would run 3 s; the trainer hears of B within that time."""
    proxy, (a, b) = fleet2
    await call(proxy, "POST", "/init_broadcaster", json=INIT)
    a.app[RL_SIM].faults.append({"kind": "delay", "delay_s": 3.0})
    b.app[RL_SIM].faults.append({"kind": "fail", "message": "refuses at once"})
    started = time.monotonic()
    status, body = await call(proxy, "POST", "/update_weights_from_distributed", json=BUCKETS[0])
    assert time.monotonic() - started < 2.5
    assert status == 503 and body["outcome"] == "held_paused"
    by_url = {w["url"]: w for w in body["workers"]}
    assert by_url[url_of(b)]["message"] == "refuses at once"
    assert by_url[url_of(a)]["message"] == f"not waited for: {url_of(b)} failed first (refuses at once)"


async def test_vllms_failed_push_destroys_the_group_so_the_same_name_joins_again(fleet2, fake_group):
    proxy, (a, b) = fleet2
    init = {"master_address": "127.0.0.1", "master_port": 29542, "rank_offset": 1, "world_size": 3}
    meta = {"names": BUCKETS[1]["names"], "dtype_names": BUCKETS[1]["dtypes"], "shapes": BUCKETS[1]["shapes"]}
    assert (await call(proxy, "POST", "/init_weight_transfer_engine", json={"init_info": init}))[0] == 200
    b.app[RL_SIM].faults.append({"kind": "partial", "message": "refuses bucket 2"})
    status, body = await call(proxy, "POST", "/update_weights", json={"update_info": meta})
    assert (status, body["outcome"]) == (503, "held_paused")
    assert f"{url_of(b)}: {PARTIAL}" in body["error"]["message"] and DESTROYED in body["error"]["message"]
    assert [s.app[WEIGHTS].groups for s in (a, b)] == [{}, {}]
    assert (await call(proxy, "GET", "/weight_info"))[1]["consistent"] is False
    assert (await call(proxy, "POST", "/init_weight_transfer_engine", json={"init_info": init}))[0] == 200
    assert await call(proxy, "POST", "/update_weights", json={"update_info": meta}) == (
        200, {"message": "Weights updated"})
    assert await call(proxy, "POST", "/finish_weight_update", json={"weight_version": "3"}) == (
        200, {"message": "Weight update finished"})
    assert (await call(proxy, "GET", "/weight_info"))[1]["consistent"] is True
    assert await call(proxy, "POST", "/resume") == (200, {"status": "resumed"})


async def test_a_step_answers_only_for_a_push_it_waited_for(make_sim, make_proxy, fake_group):
    """Item 7: /update_weights {"weight_dir": null} again without a new /pause (an HTTP retry) does not
    return the last push's result: it waits for a new push, and says why when none comes."""
    sim = await make_sim()
    proxy = await make_proxy(sim, weight_update_timeout_s=0.5)
    await call(proxy, "POST", "/init_broadcaster", json={**INIT, "inference_world_size": 1})
    await call(proxy, "POST", "/pause")
    assert [status for status, _ in await push(proxy, "1")] == [200, 200, 200]
    assert await call(proxy, "POST", "/update_weights", json={"weight_dir": None}) == (
        200, {"status": "ok", "weight_version": "1"})
    started = time.monotonic()
    status, again = await call(proxy, "POST", "/update_weights", json={"weight_dir": None})
    assert status == 504 and time.monotonic() - started >= 0.5
    assert again["error"]["message"].endswith(
        "; the last push (version 1) was already answered by an earlier /update_weights: each call answers for "
        "one push that it waited for")
    waiting = asyncio.create_task(call(proxy, "POST", "/update_weights", json={"weight_dir": None}))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    assert [status for status, _ in await push(proxy, "2")] == [200, 200, 200]
    assert await waiting == (200, {"status": "ok", "weight_version": "2"})


async def test_an_abandoned_push_is_failed_when_the_wait_runs_out(make_sim, make_proxy, fake_group):
    """The trainer sent one bucket of three and stopped: the proxy destroys the group and holds the fleet."""
    sim = await make_sim()
    proxy = await make_proxy(sim, weight_update_timeout_s=0.3)
    proxy.app[ADMIN].weights.loaded_path = None
    await call(proxy, "POST", "/init_broadcaster", json={**INIT, "inference_world_size": 1})
    await call(proxy, "POST", "/pause")
    assert (await call(proxy, "POST", "/update_weights_from_distributed", json=BUCKETS[0]))[0] == 200
    status, body = await call(proxy, "POST", "/update_weights", json={"weight_dir": None})
    assert (status, body["outcome"]) == (504, "held_paused")
    assert "the push stopped midway: no weight broadcast reached the workers within 0.3 s" in body["error"]["message"]
    assert sim.app[WEIGHTS].groups == {} and proxy.app[ADMIN].push.live_groups == set()
    assert (await call(proxy, "POST", "/resume"))[0] == 409
    assert (await call(proxy, "POST", "/resume", params={"force": "true"})) == (200, {"status": "resumed"})


async def test_finish_weight_update_keeps_the_rollouts_pause_keep_kept(make_sim, make_proxy, fake_group):
    """Item 5, SkyRL's order: pause (keep), push, finish, resume. SGLang's /update_weight_version aborts every
    request unless told not to (abort_all_requests defaults to true); the rollout must finish whole."""
    a, b = await make_sim(tpot_s=0.01), await make_sim()
    proxy = await make_proxy(a, workers=(url_of(a), url_of(b)), admin_timeout_s=5.0)

    async def kept_rollout():
        rollout = asyncio.create_task(call(proxy, "POST", "/v1/chat/completions", json=LONG))
        while not a.app[SIM_STATE].running:
            await asyncio.sleep(0.005)
        assert await call(proxy, "POST", "/pause", params={"mode": "keep"}) == (200, {"status": "paused"})
        return rollout

    # SGLang's own route, forwarded: SGLang's default would abort the kept rollout (the simulator's default is
    # SGLang's, tests/simulator/test_request_defaults.py), so the proxy sends abort_all_requests: false unless
    # the client asks for the abort (bench/chaos.py's weights_vllm lost 24 samples to it).
    rollout = await kept_rollout()
    assert (await call(proxy, "POST", "/update_weight_version", json={"new_version": "v0"}))[0] == 200
    assert await call(proxy, "POST", "/resume") == (200, {"status": "resumed"})
    status, reply = await asyncio.wait_for(rollout, 20)
    assert (status, reply["choices"][0]["finish_reason"]) == (200, "length")
    assert a.app[SIM_STATE].aborted == []
    rollout = await kept_rollout()
    assert (await call(proxy, "POST", "/update_weight_version",
                       json={"new_version": "v0b", "abort_all_requests": True}))[0] == 200
    assert await call(proxy, "POST", "/resume") == (200, {"status": "resumed"})
    status, reply = await asyncio.wait_for(rollout, 20)
    assert (status, reply["choices"][0]["finish_reason"]) == (200, "abort")  # asked for
    aborted = list(a.app[SIM_STATE].aborted)
    assert len(aborted) == 1

    rollout = await kept_rollout()
    init = {"master_address": "127.0.0.1", "master_port": 29543, "rank_offset": 1, "world_size": 3}
    assert (await call(proxy, "POST", "/init_weight_transfer_engine", json={"init_info": init}))[0] == 200
    assert (await call(proxy, "POST", "/start_weight_update"))[0] == 200  # vLLM: a finish needs a start
    assert await call(proxy, "POST", "/finish_weight_update", json={"weight_version": "v1"}) == (
        200, {"message": "Weight update finished"})
    assert [s.app[SIM_STATE].weight_version for s in (a, b)] == ["v1", "v1"]
    assert await call(proxy, "POST", "/resume") == (200, {"status": "resumed"})
    status, reply = await asyncio.wait_for(rollout, 20)
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length"
    assert len(reply["choices"][0]["token_ids"]) == 40
    assert a.app[SIM_STATE].aborted == aborted  # nothing more aborted


@pytest.mark.parametrize(("replies", "status"), [
    # both workers refused the push itself (a wrong shape): retrying it fails again
    ([("A", 400, None), ("B", 400, None)], 400),
    # A refused first and B's call was cut off ("not waited for"): B might have taken it (SGLang answers 400
    # for a receive that failed on that worker alone too), so the trainer is told to join and push again
    # (prime-rl does not retry a 4xx: 400 would end its run for what may be one worker's failure)
    ([("A", 400, None), ("B", 0, "aborted")], 503),
    ([("A", 0, "aborted"), ("B", 400, None)], 503),
    # A took it, B refused: the workers differ, a new join + push would work
    ([("A", 200, None), ("B", 400, None)], 503),
    # A refused, B cannot be reached: not the push's fault alone
    ([("A", 400, None), ("B", 0, "unavailable")], 503),
    # a worker failing mid-push (5xx) is not a refusal of the push
    ([("A", 500, None), ("B", 0, "aborted")], 503),
    ([("A", 0, "timeout"), ("B", 0, "timeout")], 504),
])
def test_a_failed_push_answers_400_only_when_every_worker_was_heard_refusing_it(replies, status):
    from token_proxy.errors import BackendTimeout, BackendUnavailable
    from token_proxy.fleet.transaction import push_status
    from token_proxy.sglang import WorkerReply
    from token_proxy.sglang.workers import aborted

    refused = WorkerReply("http://a", 400, b'{"success": false}', "application/json")
    made = []
    for url, code, error in replies:
        if error == "aborted":
            made.append(aborted(url, refused))
        elif error == "timeout":
            made.append(WorkerReply(url, 0, error=BackendTimeout("timed out")))
        elif error == "unavailable":
            made.append(WorkerReply(url, 0, error=BackendUnavailable("refused")))
        else:
            made.append(WorkerReply(url, code, b"{}", "application/json"))
    assert push_status(made) == status


# --- no label without the weights behind it (issue 41.2) ----------------------------------------------------


async def test_a_finish_after_a_rolled_back_push_relabels_nothing(fleet2, fake_group):
    """The issue's sequence: B refuses bucket 2 of 3 of a prime-rl push, every worker rolls back to the
    checkpoint ("default"), then a finish (or a bare label) with version 2 would name the old weights "2":
    409, and /weight_info still says "default". On d6350dc both answered 200 and relabelled."""
    proxy, (a, b) = fleet2
    plane = proxy.app[ADMIN]
    plane.weights.loaded_path = plane.weights.base_model_path  # the checkpoint the workers started from: rolled back to
    assert await call(proxy, "POST", "/init_broadcaster", json=INIT) == (200, {"status": "ok"})
    b.app[RL_SIM].faults.extend([{"kind": "pass"}, {"kind": "partial", "message": "refuses bucket 2"}])
    assert (await call(proxy, "POST", "/update_weights_from_distributed", json=BUCKETS[0]))[0] == 200
    status, second = await call(proxy, "POST", "/update_weights_from_distributed", json=BUCKETS[1])
    assert (status, second["outcome"]) == (503, "rolled_back")
    status, body = await call(proxy, "POST", "/update_weights", json={"weight_dir": None})
    assert status == 503 and "rolled back to version default" in body["error"]["message"]
    status, finish = await call(proxy, "POST", "/finish_weight_update", json={"weight_version": "2"})
    assert (status, finish["error"]["type"]) == (409, "ConflictError")
    # bucket 1 had opened the update (SGLang's own push opens it); bucket 2's failure closed it
    assert finish["error"]["message"].startswith("finish_weight_update: the weight update failed (")
    status, finish = await call(proxy, "POST", "/finish_weight_update", json={"weight_version": "2"})
    assert status == 409 and finish["error"]["message"].startswith(
        "finish_weight_update called without a matching start_weight_update")  # closed for good
    status, label = await call(proxy, "POST", "/update_weight_version", json={"new_version": "2"})
    assert status == 409 and label["error"]["message"].startswith(
        "update_weight_version: the last weight push failed (")
    status, info = await call(proxy, "GET", "/weight_info")
    assert [w["weight_version"] for w in info["workers"]] == ["default", "default"]
    assert [s.app[SIM_STATE].weight_version for s in (a, b)] == ["default", "default"]


async def test_a_finish_of_an_update_whose_push_failed_is_a_409_until_a_new_one_arrives(fleet2, fake_group):
    """vLLM's order (start, update_weights, finish): a failed receive closes the update, as vLLM's worker does."""
    proxy, (a, b) = fleet2
    proxy.app[ADMIN].weights.loaded_path = proxy.app[ADMIN].weights.base_model_path
    init = {"master_address": "127.0.0.1", "master_port": 29545, "rank_offset": 1, "world_size": 3}
    meta = {"names": BUCKETS[0]["names"], "dtype_names": BUCKETS[0]["dtypes"], "shapes": BUCKETS[0]["shapes"]}
    assert (await call(proxy, "POST", "/init_weight_transfer_engine", json={"init_info": init}))[0] == 200
    assert (await call(proxy, "POST", "/start_weight_update"))[0] == 200
    b.app[RL_SIM].faults.append({"kind": "fail", "message": "Failed to receive."})
    assert (await call(proxy, "POST", "/update_weights", json={"update_info": meta}))[0] == 503  # rolled back
    status, finish = await call(proxy, "POST", "/finish_weight_update", json={"weight_version": "5"})
    assert status == 409 and finish["error"]["message"].startswith("finish_weight_update: the weight update failed (")
    assert [s.app[SIM_STATE].weight_version for s in (a, b)] == ["default", "default"]
    # again, whole: the label follows the weights
    assert (await call(proxy, "POST", "/init_weight_transfer_engine", json={"init_info": init}))[0] == 200
    assert (await call(proxy, "POST", "/start_weight_update"))[0] == 200
    assert (await call(proxy, "POST", "/update_weights", json={"update_info": meta}))[0] == 200
    assert await call(proxy, "POST", "/finish_weight_update", json={"weight_version": "5"}) == (
        200, {"message": "Weight update finished"})
    assert [s.app[SIM_STATE].weight_version for s in (a, b)] == ["5", "5"]
    assert (await call(proxy, "POST", "/update_weight_version", json={"new_version": "5b"}))[0] == 200


async def test_a_finish_after_sglangs_own_push_labels_it(fleet2, fake_group):
    """token_proxy.broadcast's drop-in (vLLM's engine.send_weights, then client.finish_weight_update) pushes
    through SGLang's own route: its buckets open the update, so the finish labels them."""
    proxy, (a, b) = fleet2
    assert await call(proxy, "POST", "/init_broadcaster", json=INIT) == (200, {"status": "ok"})
    for bucket in BUCKETS:
        assert (await call(proxy, "POST", "/update_weights_from_distributed", json=bucket))[0] == 200
    assert await call(proxy, "POST", "/finish_weight_update", json={"weight_version": "step-12"}) == (
        200, {"message": "Weight update finished"})
    assert [s.app[SIM_STATE].weight_version for s in (a, b)] == ["step-12", "step-12"]
