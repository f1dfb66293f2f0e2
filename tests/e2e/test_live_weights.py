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

USER = [{"role": "user", "content": "What is the capital of France?"}]


async def post(client, path, body=None):
    resp = await client.post(path, data=orjson.dumps(body) if body is not None else None,
                             headers={"Content-Type": "application/json"})
    raw = await resp.read()
    return resp.status, orjson.loads(raw) if raw else None


async def greedy(proxy) -> dict:
    status, body = await post(proxy, "/v1/chat/completions", {"messages": USER, "max_tokens": 16, "temperature": 0,
                                                              "ignore_eos": True, "return_token_ids": True})
    assert status == 200, body
    return body["choices"][0]


async def stream(proxy, max_tokens: int) -> list[dict]:
    resp = await proxy.post("/v1/chat/completions", data=orjson.dumps({
        "messages": USER, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        "return_token_ids": True}))
    assert resp.status == 200
    frames = [f[6:] for f in (await resp.read()).decode().split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    return [orjson.loads(f) for f in frames[:-1]]


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
    import sys, torch
    from token_proxy.broadcast import SGLangBroadcaster
    url, port, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    caster = SGLangBroadcaster(url=url, master_address="127.0.0.1", master_port=port, inference_world_size=1,
                               backend=backend, device="cuda", timeout_s=60)
    caster.init()
    norm = torch.arange(64, dtype=torch.float32).mul(0.25).to(torch.bfloat16)
    caster.update([("model.norm.weight", norm)], version="nccl-1")
    caster.close()
    print("pushed")
''')


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def push(url: str, backend: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", TRAINER, url, str(free_port()), backend,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
    out, _ = await asyncio.wait_for(proc.communicate(), 180)
    return proc.returncode, out.decode()[-3000:]


async def test_broadcast_from_a_second_process_on_the_same_gpu(proxy, sglang):
    """NCCL first; NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so on a one-GPU host
    the same push goes over gloo (CUDA tensors, SGLang's same receive path) and the test says so."""
    url = str(proxy.make_url("")).rstrip("/")
    code, out = await push(url, "nccl")
    if code != 0:
        print(f"NCCL push on one GPU failed (expected: NCCL needs a GPU per rank): {out[-600:]}")
        assert (await sglang.get("/health_generate"))[0] == 200
        code, out = await push(url, "gloo")
    assert code == 0, out
    status, values = await post(proxy, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 64})
    assert status == 200, values
    flat = values if isinstance(values, list) and not isinstance(values[0], list) else sum(values, [])
    assert [round(v, 4) for v in flat[:64]] == [i * 0.25 for i in range(64)]
    _, info = await sglang.get("/model_info")
    assert info["weight_version"] == "nccl-1"
    answer = await greedy(proxy)
    assert answer["weight_versions"][-1]["version"] == "nccl-1"
