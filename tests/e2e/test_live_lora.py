"""LoRA through the proxy on a live SGLang started with LoRA enabled, e.g.
`start_sglang.sh BUNDLE TOK --enable-lora --max-lora-rank 8 --lora-target-modules q_proj k_proj v_proj o_proj`.

A tiny random adapter in PEFT's layout (made here with torch + safetensors, no download) changes the
output at temperature 0; a new step loads in place under concurrent load with no request failing; an
unloaded name is a 404; files that are not there are a 404 and an adapter above --max-lora-rank a 400.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from token_proxy.errors import NotFound
from token_proxy.lora import ADAPTERS

PROMPT = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def make_adapter(directory, config: dict, rank: int = 8, seed: int = 0):
    """Random A and B (B is not zero, unlike a fresh PEFT init, so the adapter changes the output)."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    outs = {"q_proj": hidden, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim, "o_proj": hidden}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, dtype=torch.bfloat16) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, dtype=torch.bfloat16) * 0.5
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(outs), "base_model_name_or_path": "tiny"}))
    return directory


@pytest.fixture
async def model_config(sglang):
    _, info = await sglang.get("/model_info")
    return json.loads(Path(info["model_path"], "config.json").read_text())


@pytest.fixture
async def lora_enabled(sglang):
    _, info = await sglang.get("/server_info")
    if not info.get("enable_lora"):
        pytest.skip("SGLang was not started with --enable-lora")
    return info


async def ids(sglang, lora_path: str | None) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, **({"lora_path": lora_path} if lora_path else {})}
    status, reply = await sglang.post("/generate", body)
    assert status == 200, reply
    return reply["output_ids"]


async def test_adapter_load_sample_reload_under_load_unload(proxy, sglang, model_config, lora_enabled, tmp_path):
    registry = proxy.app[ADAPTERS]
    steps = [make_adapter(tmp_path / f"step_{i}", model_config, seed=i) for i in range(1, 4)]
    response = await proxy.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(steps[0])})
    assert response.status == 200, await response.text()
    internal = registry.resolve("policy")
    base, tuned = await ids(sglang, None), await ids(sglang, internal)
    assert tuned != base and await ids(sglang, internal) == tuned  # the adapter acts, deterministically
    _, models = await sglang.get("/v1/models")
    assert internal in [card["id"] for card in models["data"]]

    failures: list[str] = []

    async def rollout() -> None:  # as prime-rl samples: model=<adapter name>, through the proxy
        body = {"model": "policy", "token_ids": PROMPT,
                "sampling_params": {"temperature": 0, "max_tokens": 64, "ignore_eos": True}}
        response = await proxy.post("/inference/v1/generate", json=body)
        if response.status != 200:
            failures.append(await response.text())

    async def trainer() -> None:
        for step in steps[1:]:
            await asyncio.sleep(0.2)
            response = await proxy.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(step)})
            assert response.status == 200, await response.text()

    await asyncio.gather(trainer(), *(rollout() for _ in range(64)))
    assert failures == [] and registry.resolve("policy") == "policy@v3"
    response = await proxy.post("/v1/unload_lora_adapter", json={"lora_name": "policy"})
    assert response.status == 200
    with pytest.raises(NotFound):
        registry.resolve("policy")
    for _ in range(100):
        _, models = await sglang.get("/v1/models")
        if not any(card["id"].startswith("policy@") for card in models["data"]):
            break
        await asyncio.sleep(0.1)
    assert [card["id"] for card in models["data"]] == [models["data"][0]["id"]]  # every step unloaded
    again = await proxy.post("/v1/unload_lora_adapter", json={"lora_name": "policy"})
    assert again.status == 404


async def test_missing_files_404_and_oversized_rank_400(proxy, live_proxy, sglang, model_config, lora_enabled,
                                                        tmp_path):
    missing = await proxy.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "late")})
    assert missing.status == 404
    big = make_adapter(tmp_path / "big", model_config, rank=16)
    refused = await proxy.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(big)})
    assert refused.status == 400
    # The proxy checks what /server_info reports; without it, SGLang's own refusal is the 400.
    unchecked = await (await live_proxy(check_local_paths=False)).post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(big)})
    assert unchecked.status == 400 and "rank" in (await unchecked.json())["error"]["message"]
    assert (await sglang.get("/health"))[0] == 200
