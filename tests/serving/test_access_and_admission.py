"""Access control and overload protection, as units and through a live proxy."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from token_proxy.http_io import kind_in
from token_proxy.ops.admission import ADMISSION, Admission, Overloaded, samples_of
from token_proxy.ops.auth import AccessPolicy, Forbidden, Unauthorized
from token_proxy.routes import ROUTES
from token_proxy.simulator import SIM_STATE

USER = [{"role": "user", "content": "hi"}]


TABLE = {route.path: route for route in ROUTES}  # as add_routes lists it on the app (http_io.route_kind)


@pytest.mark.parametrize("policy,path,auth,remote,error", [
    (AccessPolicy(), "/v1/chat/completions", None, "10.0.0.5", None),
    (AccessPolicy(), "/pause", None, "127.0.0.1", None),
    (AccessPolicy(), "/pause", None, "::1", None),
    (AccessPolicy(), "/pause", None, "10.0.0.5", Forbidden),
    (AccessPolicy(admin_open=True), "/pause", None, "10.0.0.5", None),
    (AccessPolicy(api_key="key-123"), "/v1/chat/completions", None, "127.0.0.1", Unauthorized),
    (AccessPolicy(api_key="key-123"), "/v1/chat/completions", "Bearer wrong-789", "127.0.0.1", Unauthorized),
    (AccessPolicy(api_key="key-123"), "/v1/chat/completions", "Bearer key-123", "10.0.0.5", None),
    (AccessPolicy(api_key="key-123"), "/v1/chat/completions", "bearer key-123", "10.0.0.5", None),
    (AccessPolicy(api_key="key-123"), "/health", None, "10.0.0.5", None),
    (AccessPolicy(api_key="key-123", admin_key="adm-456"), "/update_weights", "Bearer key-123", "127.0.0.1", Unauthorized),
    (AccessPolicy(api_key="key-123", admin_key="adm-456"), "/update_weights", "Bearer adm-456", "10.0.0.5", None),
    (AccessPolicy(api_key="key-123", admin_key="adm-456"), "/v1/completions", "Bearer adm-456", "10.0.0.5", None),
    (AccessPolicy(admin_key="adm-456"), "/release_memory_occupation", None, "127.0.0.1", Unauthorized),
    (AccessPolicy(admin_key="adm-456"), "/some/unknown/sglang/route", "Bearer adm-456", "10.0.0.5", None),
])
def test_access_policy(policy, path, auth, remote, error):
    if error is None:
        policy.check(path, auth, remote, kind_in(TABLE, path))
    else:
        with pytest.raises(error) as exc:
            policy.check(path, auth, remote, kind_in(TABLE, path))
        for secret in ("key-123", "adm-456", "wrong-789"):
            assert secret not in exc.value.message  # nothing secret echoed


async def test_admission_bounds_active_and_queue_and_hands_slots_in_order():
    adm = Admission(max_active=2, max_queued=1, queue_timeout_s=5.0)
    await adm.acquire()
    await adm.acquire()
    waiter = asyncio.ensure_future(adm.acquire())
    await asyncio.sleep(0)
    assert adm.active == 2 and adm.queued == 1
    with pytest.raises(Overloaded) as exc:
        await adm.acquire()
    assert exc.value.status == 503 and exc.value.headers() == {"Retry-After": "1"}
    adm.release()
    await waiter
    assert adm.active == 2 and adm.queued == 0
    adm.release()
    adm.release()
    assert adm.active == 0


async def test_admission_queue_timeout_and_cancelled_waiter_free_their_place():
    adm = Admission(max_active=1, max_queued=2, queue_timeout_s=0.05)
    await adm.acquire()
    with pytest.raises(Overloaded):
        await adm.acquire()
    assert adm.queued == 0
    waiter = asyncio.ensure_future(adm.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.queued == 0
    adm.release()
    assert adm.active == 0


async def test_overloaded_proxy_answers_503_with_retry_after(make_sim, make_proxy):
    sim = await make_sim(tpot_s=0.05)
    proxy = await make_proxy(sim, max_concurrent_requests=1, max_queued_requests=1, queue_timeout_s=30.0)
    body = orjson.dumps({"messages": USER, "max_tokens": 20, "ignore_eos": True})
    first = asyncio.ensure_future(proxy.post("/v1/chat/completions", data=body))
    second = asyncio.ensure_future(proxy.post("/v1/chat/completions", data=body))
    state, admission = sim.app[SIM_STATE], proxy.app[ADMISSION]
    deadline = asyncio.get_running_loop().time() + 10
    while not (state.running and admission.queued == 1):  # first running, second queued (polled: load)
        assert asyncio.get_running_loop().time() < deadline, (len(state.running), admission.queued)
        await asyncio.sleep(0.01)
    third = await proxy.post("/v1/chat/completions", data=body)
    assert third.status == 503
    assert third.headers["Retry-After"] == "1"
    assert (await third.json())["error"]["type"] == "ServiceUnavailableError"
    assert (await first).status == 200 and (await second).status == 200
    assert (await proxy.get("/health")).status == 200  # never queued behind inference


def test_a_body_counts_its_samples():
    bodies = [b'{"prompt": "hi"}', b'{"n": 8}', b'{"sampling_params": {"n": 3}}', b'{"n": 1, "sampling_params": {"n": 5}}',
              b'{"n": true}', b'{"n": "8"}', b'{"n": 0}', b'not json "n"', b'[{"n": 2}]', b'{"prompt": "\\"n\\""}']
    assert [samples_of(body) for body in bodies] == [1, 8, 3, 1, 1, 1, 1, 1, 1, 1]


async def test_admission_weighs_samples_in_order_and_caps_a_request_at_every_slot():
    adm = Admission(max_active=4, max_queued=2, queue_timeout_s=5.0)
    assert (adm.weight_of(64), adm.weight_of(0), adm.weight_of(3)) == (4, 1, 3)
    await adm.acquire(3)
    big = asyncio.ensure_future(adm.acquire(2))  # does not fit: queued
    small = asyncio.ensure_future(adm.acquire(1))  # would fit, but waits behind the queue's head
    await asyncio.sleep(0)
    assert (adm.active, adm.queued) == (3, 2)
    adm.release(3)
    await asyncio.gather(big, small)
    assert (adm.active, adm.queued) == (3, 0)
    adm.release(2)
    adm.release(1)
    assert adm.active == 0


async def test_one_request_with_n_samples_takes_n_slots(make_sim, make_proxy):
    """--max-concurrent-requests 4: a request with n = 4 fills the proxy, so the next one queues and the
    one after is refused (before: n = 4 counted as one request, and both others ran beside it)."""
    sim = await make_sim(tpot_s=0.05)
    proxy = await make_proxy(sim, max_concurrent_requests=4, max_queued_requests=1, queue_timeout_s=30.0)
    admission = proxy.app[ADMISSION]
    big = asyncio.ensure_future(proxy.post("/v1/chat/completions", data=orjson.dumps(
        {"messages": USER, "max_tokens": 20, "ignore_eos": True, "n": 4})))
    small = orjson.dumps({"messages": USER, "max_tokens": 2})
    deadline = asyncio.get_running_loop().time() + 10
    while admission.active != 4:
        assert asyncio.get_running_loop().time() < deadline and not big.done(), admission.active
        await asyncio.sleep(0.01)
    queued = asyncio.ensure_future(proxy.post("/v1/chat/completions", data=small))
    while admission.queued != 1:
        assert asyncio.get_running_loop().time() < deadline and not queued.done(), admission.queued
        await asyncio.sleep(0.01)
    refused = await proxy.post("/v1/chat/completions", data=small)
    assert (refused.status, refused.headers["Retry-After"]) == (503, "1")
    assert (await refused.json())["error"]["message"] == (
        "The proxy is at capacity (4 samples in flight, 1 requests queued) and the queue is full; retry later")
    first, second = await big, await queued
    assert (first.status, len((await first.json())["choices"]), second.status) == (200, 4, 200)
    assert admission.active == 0


async def test_api_key_is_required_on_inference_when_configured(make_sim, make_proxy):
    sim = await make_sim()
    proxy = await make_proxy(sim, api_key="sekret")
    body = orjson.dumps({"messages": USER, "max_tokens": 1})
    resp = await proxy.post("/v1/chat/completions", data=body)
    assert resp.status == 401
    text = await resp.text()
    assert "sekret" not in text and resp.headers["WWW-Authenticate"] == "Bearer"
    resp = await proxy.post("/v1/chat/completions", data=body, headers={"Authorization": "Bearer sekret"})
    assert resp.status == 200
    assert (await proxy.get("/health")).status == 200


def test_weight_paths_stay_under_the_allowed_roots(tmp_path):
    from token_proxy.checks import local_dir
    from token_proxy.errors import InvalidRequest
    from token_proxy.settings import Settings

    root, outside = tmp_path / "ckpt", tmp_path / "elsewhere"
    (root / "step_1").mkdir(parents=True)
    outside.mkdir()
    (root / "escape").symlink_to(outside, target_is_directory=True)
    settings = Settings(backend_url="http://x", weight_dirs=(str(root),))
    assert local_dir(str(root / "step_1"), "weight_dir", settings) == str(root / "step_1")
    for bad, why in ((str(outside), "outside"), (str(root / "escape"), "outside"),
                     (f"{root}/step_1/../../elsewhere", "'..'"), ("Qwen/Qwen3-4B", "hub id")):
        with pytest.raises(InvalidRequest) as exc:
            local_dir(bad, "weight_dir", settings)
        assert why in exc.value.message and exc.value.param == "weight_dir"
    open_settings = Settings(backend_url="http://x")
    assert local_dir("Qwen/Qwen3-4B", "weight_dir", open_settings) == "Qwen/Qwen3-4B"


async def test_admin_key_guards_admin_routes_and_weight_dirs_are_enforced(make_sim, make_proxy, tmp_path):
    sim = await make_sim()
    proxy = await make_proxy(sim, admin_key="adm-456", weight_dirs=(str(tmp_path),))
    resp = await proxy.post("/pause")
    assert resp.status == 401 and "adm-456" not in await resp.text()
    resp = await proxy.post("/update_weights", json={"weight_dir": "/etc"},
                            headers={"Authorization": "Bearer adm-456"})
    body = await resp.json()
    assert resp.status == 400 and body["error"]["param"] == "weight_dir"
    assert "outside the allowed weight directories" in body["error"]["message"]
    resp = await proxy.post("/pause", headers={"Authorization": "Bearer adm-456"})
    assert resp.status == 200
    resp = await proxy.post("/resume", headers={"Authorization": "Bearer adm-456"})
    assert resp.status == 200
