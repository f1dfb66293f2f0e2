"""ART's (OpenPipe) calls to its vLLM runtime, replayed against the proxy (issue 39).

Source: PyPI `openpipe-art` 0.5.18, art/unsloth/service.py (UnslothService, dedicated mode): the merged-weights
sync (`_init_merged_weight_transfer`, `_sync_merged_weights`, `_set_served_model_name`), the LoRA step
(`_reload_adapter`, `_unload_adapter`) and `register_lora_for_step`, each with httpx and the runtime's key as
`Authorization: Bearer`. The NCCL join and receive are the simulator's (`fake_group`); ART's own sender sends
packed buffers, which SGLang cannot receive (the proxy answers 501, tests/admin/test_vllm_rl.py), so the
update here is the unpacked one.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.admin_fixtures import proxy_url
from tests.support.lora_fixtures import write_adapter
from token_proxy.simulator.weight_routes import WEIGHTS

BASE = "sim/qwen2-tiny"
KEY = "art-runtime-key"
META = {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[8]]}
AUTH = {"headers": {"Authorization": f"Bearer {KEY}"}}


@pytest.fixture
async def runtime(make_sim, make_proxy):
    """ART's runtime is one vLLM with one key: the proxy's API key and admin key are that key."""
    sim = await make_sim()
    return await make_proxy(sim, api_key=KEY, admin_key=KEY), sim


async def model_ids(client: httpx.AsyncClient, url: str) -> list[str]:
    response = await client.get(f"{url}/v1/models", **AUTH)
    assert response.status_code == 200
    return [card["id"] for card in response.json()["data"]]


async def chat(client: httpx.AsyncClient, url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return await client.post(f"{url}/v1/chat/completions", json=body, **AUTH)


async def test_art_merged_weight_sync_replayed_verbatim(runtime, fake_group):
    proxy, sim = runtime
    url = proxy_url(proxy)
    async with httpx.AsyncClient() as client:
        # _init_merged_weight_transfer
        response = await client.get(f"{url}/get_world_size", **AUTH, timeout=30.0)
        assert (response.status_code, response.json()) == (200, {"world_size": 1})
        init_info = {"master_address": "127.0.0.1", "master_port": 29541, "rank_offset": 1,
                     "world_size": response.json()["world_size"] + 1}
        response = await client.post(f"{url}/init_weight_transfer_engine", json={"init_info": init_info}, **AUTH,
                                     timeout=300.0)
        assert response.status_code == 200, response.text
        for step in (1, 2):  # _sync_merged_weights(step, pause_generation=True)
            response = await client.post(f"{url}/pause", params={"mode": "wait"}, **AUTH, timeout=300.0)
            assert response.status_code == 200, response.text
            response = await client.post(f"{url}/start_weight_update", json={"is_checkpoint_format": True}, **AUTH,
                                         timeout=300.0)
            assert response.status_code == 200, response.text
            response = await client.post(f"{url}/update_weights", json={"update_info": META}, **AUTH, timeout=600.0)
            assert response.status_code == 200, response.text
            response = await client.post(f"{url}/finish_weight_update", **AUTH, timeout=600.0)
            assert response.status_code == 200, response.text
            # _set_served_model_name(step)
            response = await client.post(f"{url}/art/set_served_model_name", json={"name": f"{BASE}@{step}"},
                                         **AUTH, timeout=30.0)
            assert (response.status_code, response.json()) == (200, {"name": f"{BASE}@{step}"})
            response = await client.post(f"{url}/resume", **AUTH, timeout=30.0)
            assert response.status_code == 200, response.text
            # the rollouts of the step name the new model; the old name stops answering
            assert await model_ids(client, url) == [f"{BASE}@{step}"]
            response = await chat(client, url, f"{BASE}@{step}")
            assert (response.status_code, response.json()["model"]) == (200, f"{BASE}@{step}")
            old = BASE if step == 1 else f"{BASE}@{step - 1}"
            response = await chat(client, url, old)
            assert response.status_code == 404
            assert response.json()["error"]["message"] == f"The model `{old}` does not exist."
        response = await chat(client, url, None)  # no model: the served one, under its new name
        assert (response.status_code, response.json()["model"]) == (200, f"{BASE}@2")
    assert [update["names"] for update in sim.app[WEIGHTS].updates] == [META["names"]] * 2
    assert [join["rank"] for join in fake_group] == [1]


async def test_art_lora_step_replayed_verbatim(runtime, tmp_path):
    """register_lora_for_step in LoRA mode: _reload_adapter, rollouts on `name@step`, _unload_adapter."""
    proxy, _ = runtime
    url = proxy_url(proxy)
    async with httpx.AsyncClient() as client:
        for step in (1, 2):
            response = await client.post(f"{url}/v1/load_lora_adapter", json={
                "lora_name": f"agent@{step}", "lora_path": str(write_adapter(tmp_path, f"step_{step}")),
                "load_inplace": True}, **AUTH, timeout=60.0)
            assert (response.status_code, response.text) == (
                200, f"Success: LoRA adapter 'agent@{step}' added successfully.")
            response = await chat(client, url, f"agent@{step}")
            assert (response.status_code, response.json()["model"]) == (200, f"agent@{step}")
        response = await client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "agent@1"}, **AUTH,
                                     timeout=60.0)
        assert response.status_code == 200, response.text
        assert await model_ids(client, url) == [BASE, "agent@2"]


async def test_art_routes_need_the_key_and_a_name(runtime):
    proxy, _ = runtime
    url = proxy_url(proxy)
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/art/set_served_model_name", json={"name": "x"})
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "AuthenticationError"
        response = await client.post(f"{url}/art/set_served_model_name", json={"name": "x"},
                                     headers={"Authorization": "Bearer wrong"})
        assert response.status_code == 401
        for body in ({}, {"name": ""}, {"name": 3}):
            response = await client.post(f"{url}/art/set_served_model_name", json=body, **AUTH)
            assert (response.status_code, response.json()["error"]["param"]) == (400, "name"), body
        assert await model_ids(client, url) == [BASE]  # nothing renamed by a refused call
