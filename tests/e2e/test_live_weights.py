"""Weight updates on a live SGLang through the proxy: from disk under load, and over NCCL from a
second process on the same GPU (the trainer-side broadcaster)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import orjson
import pytest

from token_proxy.simulator.testing import stream_events

USER = [{"role": "user", "content": "What is the capital of France?"}]


async def post(client, path, body=None):
    resp = await client.post(path, data=orjson.dumps(body) if body is not None else None,
                             headers={"Content-Type": "application/json"})
    raw = await resp.read()
    return resp.status, orjson.loads(raw) if raw else None


async def greedy(proxy) -> dict:
    status, body = await post(proxy, "/v1/chat/completions", {"messages": USER, "max_tokens": 16, "temperature": 0,
                                                              "ignore_eos": True, "return_token_ids": True,
                                                              "logprobs": True})
    assert status == 200, body
    return body["choices"][0]


async def fresh_greedy(proxy) -> dict:
    """`greedy` on an empty prefix cache, through the proxy's /flush_cache (nothing runs meanwhile).

    Logprobs are compared bit for bit only like for like. A prompt whose prefix is cached is prefilled from
    its last token over the cached KV; an uncached one in one pass over every token: other kernel shapes and
    reduction orders, which may differ in the fifth decimal with the very same weights. Seen on a LoRA-enabled
    SGLang 0.5.17: `before` prefilled over the prefix the previous test had cached, `restored` in one pass
    after the push's flush, same ids, -10.85008717 vs -10.85007381. The pushed values themselves arrive
    exactly: the checkpoint's bf16 tensor is broadcast as bf16 into a bf16 buffer and copied into the
    parameter (SGLang's update_weights_from_distributed), with no dtype round trip."""
    resp = await proxy.post("/flush_cache")
    assert resp.status == 200, await resp.text()
    return await greedy(proxy)


def logprobs_of(choice: dict) -> list[float]:
    return [e["logprob"] for e in choice["logprobs"]["content"]]


async def stream(proxy, max_tokens: int) -> list[dict]:
    resp = await proxy.post("/v1/chat/completions", data=orjson.dumps({
        "messages": USER, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        "return_token_ids": True}))
    assert resp.status == 200
    return stream_events(await resp.read())


@pytest.fixture
async def model_path(sglang):
    _, info = await sglang.get("/model_info")
    return info["model_path"]


def perturbed_copy(model_path: str, out: str, scale: float = 0.5) -> str:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_path, out, dirs_exist_ok=True)
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            path = os.path.join(out, name)
            tensors = load_file(path)
            torch.manual_seed(7)
            save_file({k: (v.float() + scale * torch.randn_like(v.float())).to(v.dtype) for k, v in tensors.items()},
                      path)
    return out


async def test_update_from_disk_under_load(proxy, sglang, model_path, tmp_path):
    before = await greedy(proxy)
    perturbed = perturbed_copy(model_path, str(tmp_path / "step_1"))
    rollouts = [asyncio.ensure_future(stream(proxy, 400)) for _ in range(4)]
    await asyncio.sleep(0.3)
    assert await post(proxy, "/pause") == (200, {"status": "paused"})
    status, reply = await post(proxy, "/update_weights", {"weight_dir": perturbed})
    assert status == 200 and reply["status"] == "ok", reply
    new_version = reply["weight_version"]
    assert await post(proxy, "/resume") == (200, {"status": "resumed"})
    for chunks in await asyncio.gather(*rollouts):  # none lost, none hung
        last = [c for c in chunks if c["choices"]][-1]["choices"][0]
        assert last["finish_reason"] == "length"
        ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
        assert len(ids) == 400
        versions = [span["version"] for span in last["weight_versions"]]
        assert versions[-1] == new_version
    after = await greedy(proxy)
    assert after["token_ids"] != before["token_ids"]
    assert after["weight_versions"][-1]["version"] == new_version
    _, info = await sglang.get("/model_info")
    assert info["weight_version"] == new_version
    # back to the original weights for the other tests
    status, reply = await post(proxy, "/update_weights", {"weight_dir": model_path, "weight_version": "restored"})
    assert status == 200, reply
    assert (await greedy(proxy))["token_ids"] == before["token_ids"]


async def test_bad_update_is_refused_and_sglang_stays_healthy(proxy, sglang, tmp_path):
    status, reply = await post(proxy, "/update_weights", {"weight_dir": str(tmp_path / "missing")})
    assert status == 400 and reply["error"]["param"] == "weight_dir"
    (tmp_path / "empty").mkdir()
    status, reply = await post(proxy, "/update_weights", {"weight_dir": str(tmp_path / "empty")})
    assert status == 400 and "Cannot find any model weights" in reply["error"]["message"]
    status, reply = await post(proxy, "/init_broadcaster", {"host": "127.0.0.1", "port": 0, "timeout": 5,
                                                             "rank_offset": 0, "inference_world_size": 1})
    assert status == 400 and reply["error"]["param"] == "port"
    assert (await sglang.get("/health_generate"))[0] == 200


TRAINER = textwrap.dedent('''
    import os, sys, torch
    from safetensors.torch import load_file
    from token_proxy.broadcast import SGLangBroadcaster
    url, port, backend, mode, model_dir, version = sys.argv[1:7]
    caster = SGLangBroadcaster(url=url, master_address="127.0.0.1", master_port=int(port), inference_world_size=1,
                               backend=backend, device="cuda", timeout_s=60, group_name=f"e2e-{backend}-{mode}")
    caster.init()
    print(f"NCCL_CUMEM_ENABLE={os.environ.get('NCCL_CUMEM_ENABLE')}")  # the broadcaster's, for NCCL
    name = "model.embed_tokens.weight"  # tied to lm_head: every logit moves
    original = load_file(f"{model_dir}/model.safetensors")[name]
    if mode == "perturb":
        torch.manual_seed(0)
        tensor = (torch.randn(original.shape) * 0.05).to(original.dtype)
    else:  # the model's own values, from its checkpoint
        tensor = original
    caster.update([(name, tensor)], version=version)
    caster.close()
    print("pushed")
''')


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def push(url: str, backend: str, mode: str, model_dir: str, version: str) -> tuple[int, str]:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    env.pop("NCCL_CUMEM_ENABLE", None)  # nothing by hand: the broadcaster must match SGLang's setting itself
    if os.environ.get("E2E_TRAINER_GPU"):  # a GPU of its own for the trainer: NCCL needs one per rank
        env["CUDA_VISIBLE_DEVICES"] = os.environ["E2E_TRAINER_GPU"]
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", TRAINER, url, str(free_port()), backend, mode,
                                                model_dir, version, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, env=env)
    out, _ = await asyncio.wait_for(proc.communicate(), 180)
    return proc.returncode, out.decode()[-3000:]


async def test_broadcast_from_a_second_process_on_the_same_gpu(proxy, sglang, model_path):
    """NCCL from a trainer process: with `E2E_TRAINER_GPU` (a GPU other than SGLang's) on that GPU, NCCL
    only, with no NCCL setting given by hand (the broadcaster sets NCCL_CUMEM_ENABLE=0, SGLang's; issue 28).
    Without it the trainer shares SGLang's GPU, where NCCL refuses two ranks ("Duplicate GPU detected"):
    the same push then goes over gloo (CUDA tensors, SGLang's same receive path), and the test, having
    checked it, ends as a skip that says NCCL was not tested.
    SGLang 0.5.17 has no get_weights_by_name for Qwen2, so the values are checked by their effect:
    perturbed embeddings -> the greedy output changes; the checkpoint's own values pushed back -> it
    returns exactly (each measured on an empty prefix cache: fresh_greedy says why)."""
    url = str(proxy.make_url("")).rstrip("/")
    trainer_gpu = os.environ.get("E2E_TRAINER_GPU")
    before = await fresh_greedy(proxy)
    backend = "nccl"
    code, out = await push(url, backend, "perturb", model_path, "nccl-1")
    if trainer_gpu:  # with a GPU per rank, NCCL itself must work: no fallback
        assert code == 0, f"NCCL push from the trainer on GPU {trainer_gpu} failed: {out}"
    if code != 0:
        print(f"NCCL push on one GPU failed (expected: NCCL needs a GPU per rank): {out[-600:]}")
        assert "Duplicate GPU detected" in out, out
        assert (await sglang.get("/health_generate"))[0] == 200  # SGLang survived the failed push
        status, reply = await post(proxy, "/destroy_weights_update_group", {"group_name": "e2e-nccl-perturb"})
        # the failed trainer asks SGLang to leave the group too: it may have been first
        assert status == 200 or "The group to be destroyed does not exist." in str(reply), reply
        backend = "gloo"
        code, out = await push(url, backend, "perturb", model_path, "nccl-1")
    assert code == 0, out
    if backend == "nccl":
        assert "NCCL_CUMEM_ENABLE=0" in out, out
    _, info = await sglang.get("/model_info")
    assert info["weight_version"] == "nccl-1"
    perturbed = await fresh_greedy(proxy)
    assert logprobs_of(perturbed) != logprobs_of(before)  # the pushed values reached the model
    assert perturbed["weight_versions"][-1]["version"] == "nccl-1"
    code, out = await push(url, backend, "restore", model_path, "nccl-2")
    assert code == 0, out
    restored = await fresh_greedy(proxy)
    assert restored["token_ids"] == before["token_ids"]  # every value landed exactly
    assert logprobs_of(restored) == logprobs_of(before)
    assert restored["weight_versions"][-1]["version"] == "nccl-2"
    if backend == "gloo":
        pytest.skip("NCCL not tested: the trainer shared SGLang's GPU, so the push went over gloo (it landed); "
                    "set E2E_TRAINER_GPU to a GPU other than SGLang's to test NCCL")
