"""A distributed receive that breaks midway, as SGLang 0.5.17 answers it (model_runner_components/
weight_updater.py): the tensors that arrived are loaded and the rest stay old, the reply is the 400 saying the
weights are "partially updated", and the group stays registered, so a join with its name is refused (torch's
"The specified group name has already been used") until /destroy_weights_update_group. Groups are joined
without torch here (the receive hands back stand-in tensors); tests/admin/test_broadcast.py joins for real."""

from __future__ import annotations

import aiohttp
import pytest

from tests.support.admin_fixtures import FakeTensor
from token_proxy.simulator import params
from token_proxy.simulator.rl_routes import RL_SIM
from token_proxy.simulator.weight_routes import WEIGHTS

JOIN = {"master_address": "127.0.0.1", "master_port": 29531, "rank_offset": 1, "world_size": 2}
BUCKET = {"names": ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"],
          "dtypes": ["bfloat16", "bfloat16"], "shapes": [[8, 8], [8, 16]]}
USED = ("Failed to initialize custom process group: The specified group name has already been used, please use a "
        "different group name.")


@pytest.fixture
def no_torch(monkeypatch):
    monkeypatch.setattr(params, "join_group", lambda *args: object())
    monkeypatch.setattr(params, "receive", lambda group, dtypes, shapes: [FakeTensor(s) for s in shapes])
    monkeypatch.setattr(params, "leave_group", lambda group: None)


async def reply(response) -> tuple[int, dict]:
    return response.status, await response.json()


async def test_a_receive_that_breaks_midway_leaves_partial_weights_and_its_group(make_sim, no_torch):
    sim = await make_sim()
    weights = sim.app[WEIGHTS]
    old = dict(weights.values)
    async with aiohttp.ClientSession(str(sim.make_url(""))) as http:
        assert await reply(await http.post("/init_weights_update_group", json=JOIN)) == (
            200, {"success": True, "message": "Succeeded to initialize custom process group."})
        sim.app[RL_SIM].faults.append({"kind": "partial", "message": "NCCL error: peer gone"})
        assert await reply(await http.post("/update_weights_from_distributed", json=BUCKET)) == (
            400, {"success": False, "message": "Failed to update parameter online: NCCL error: peer gone. The full "
                  "weights of the ModelRunner are partially updated. Please discard the whole weights."})
        q_proj, down_proj = BUCKET["names"]
        assert isinstance(weights.values[q_proj], FakeTensor)  # arrived and loaded
        assert weights.values[down_proj] == old[down_proj]  # never arrived: the old tensor
        assert list(weights.groups) == ["weight_update_group"]  # still registered
        assert await reply(await http.post("/init_weights_update_group", json=JOIN)) == (
            400, {"success": False, "message": USED})
        assert await reply(await http.post("/destroy_weights_update_group", json={})) == (
            200, {"success": True, "message": "Succeeded to destroy custom process group."})
        assert await reply(await http.post("/destroy_weights_update_group", json={})) == (
            400, {"success": False, "message": "The group to be destroyed does not exist."})
        assert (await http.post("/init_weights_update_group", json=JOIN)).status == 200
        assert (await http.post("/update_weights_from_distributed", json=BUCKET)).status == 200
    assert isinstance(weights.values[down_proj], FakeTensor)
