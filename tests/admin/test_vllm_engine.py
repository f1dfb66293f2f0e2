"""The drop-in for vLLM's trainer-side NCCL engine: vLLM's call shape (trainer_init / send_weights /
shutdown with an HTTPVLLMWeightSyncClient-like client), SGLang's wire protocol, through the proxy."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import pytest

from tests.support.admin_fixtures import free_port, proxy_url, sim_process
from token_proxy.broadcast import BroadcastError, nccl_env, vllm_engine
from token_proxy.broadcast.vllm_engine import SGLangTrainerWeightTransferEngine


@dataclass
class Client:
    """What the engine reads of vLLM's HTTPVLLMWeightSyncClient."""

    base_url: str
    timeout: float = 300


class Recorder:
    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []

    def init(self, announce=True):
        self.calls.append(("init", announce))

    def update(self, pairs, version=None):
        self.calls.append(("update", [name for name, _ in pairs], version))
        return 1

    def close(self):
        self.calls.append(("close",))


def test_vllm_call_shape_maps_onto_the_broadcaster(monkeypatch):
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    made = []
    monkeypatch.setattr(vllm_engine, "SGLangBroadcaster", lambda **kw: made.append(Recorder(**kw)) or made[-1])
    info = {"master_address": "10.0.0.1", "master_port": 29500, "world_size": 9, "rank": 0, "packed": True}
    source = [("model.norm.weight", object()), ("lm_head.weight", object())]
    engine = SGLangTrainerWeightTransferEngine.trainer_init(info, client=Client("http://proxy:8000"), source=source)
    assert engine.is_sender
    assert made[0].kwargs == {"url": "http://proxy:8000", "master_address": "10.0.0.1", "master_port": 29500,
                              "inference_world_size": 8, "backend": "nccl", "timeout_s": 300.0}
    assert engine.send_weights("step-3") == 1
    engine.shutdown()
    assert made[0].calls == [("init", True), ("update", ["model.norm.weight", "lm_head.weight"], "step-3"),
                             ("close",)]
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0"  # set before the broadcaster existed: see the next test


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_sets_sglangs_nccl_setting_before_anything_joins(monkeypatch, rank):
    """Rank 0's group with SGLang and the trainer's own communicators must all agree with SGLang's
    NCCL_CUMEM_ENABLE=0, so every rank sets it, before rank 0's broadcaster is even built."""
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    seen = []
    monkeypatch.setattr(vllm_engine, "SGLangBroadcaster",
                        lambda **kw: seen.append(os.environ.get("NCCL_CUMEM_ENABLE")) or Recorder(**kw))
    engine = SGLangTrainerWeightTransferEngine.trainer_init(
        {"master_address": "h", "master_port": 1, "world_size": 2, "rank": rank}, client="http://x", source=[])
    assert engine.is_sender == (rank == 0)
    assert seen == (["0"] if rank == 0 else [])
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0"


@pytest.mark.parametrize("rank", [0, 1])
def test_nccl_already_in_use_without_the_setting_fails_on_every_rank_in_one_line(monkeypatch, rank):
    """On CPU: the trainer's own NCCL world (torch.distributed's default group) is simulated by a
    monkeypatched detector; CPU torch has no NCCL."""
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    monkeypatch.setattr(nccl_env, "nccl_groups", lambda: ["default"])
    monkeypatch.setattr(vllm_engine, "SGLangBroadcaster", lambda **kw: pytest.fail("joined anyway"))
    with pytest.raises(BroadcastError) as too_late:
        SGLangTrainerWeightTransferEngine.trainer_init(
            {"master_address": "h", "master_port": 1, "world_size": 2, "rank": rank}, client="http://x", source=[])
    assert str(too_late.value) == (
        "NCCL is already in use in this process (torch.distributed group(s) default on nccl) without "
        "NCCL_CUMEM_ENABLE=0, which SGLang needs and NCCL reads only once: start the trainer with "
        "NCCL_CUMEM_ENABLE=0 in its environment (as SGLang runs), e.g. `NCCL_CUMEM_ENABLE=0 torchrun ...`")
    assert "NCCL_CUMEM_ENABLE" not in os.environ


def test_other_ranks_only_iterate_their_source(monkeypatch):
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    monkeypatch.setattr(vllm_engine, "SGLangBroadcaster", lambda **kw: pytest.fail("rank 1 opened an endpoint"))
    seen = []

    class Source:
        def iter_full(self):
            for name in ("a", "b"):
                seen.append(name)
                yield name, None

    engine = SGLangTrainerWeightTransferEngine.trainer_init(
        {"master_address": "h", "master_port": 1, "world_size": 2, "rank": 1}, client="http://x", source=Source())
    assert not engine.is_sender and engine.send_weights() == 0 and seen == ["a", "b"]
    with pytest.raises(ValueError, match="init_info needs master_port"):
        SGLangTrainerWeightTransferEngine.trainer_init({"master_address": "h", "world_size": 2, "rank": 0},
                                                       client="http://x", source=[])


async def test_drop_in_pushes_through_the_proxy_and_finish_sets_the_version(make_proxy, tokenizer_dir):
    torch = pytest.importorskip("torch")
    from token_proxy.simulator.params import PARAM_SHAPES

    with sim_process(tokenizer_dir) as url:
        proxy = await make_proxy(url)
        weights = {name: torch.full(shape, 0.5 + k, dtype=torch.bfloat16)
                   for k, (name, shape) in enumerate(PARAM_SHAPES.items())}
        info = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2, "rank": 0}
        engine = await asyncio.to_thread(SGLangTrainerWeightTransferEngine.trainer_init, info,
                                         client=Client(proxy_url(proxy)), source=list(weights.items()),
                                         backend="gloo", timeout_s=10.0)
        await asyncio.to_thread(engine.send_weights)
        finished = await proxy.post("/finish_weight_update", json={"weight_version": "step-1"})
        assert (finished.status, await finished.json()) == (200, {"message": "Weight update finished"})
        assert (await (await proxy.get("/weight_info")).json())["weight_version"] == "step-1"
        norm = await proxy.post("/get_weights_by_name", json={"name": "model.norm.weight"})
        assert await norm.json() == weights["model.norm.weight"].float().tolist()
        await asyncio.to_thread(engine.shutdown)
