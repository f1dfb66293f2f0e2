"""A tiny adapter in PEFT's layout (adapter_config.json + adapter_model.safetensors), as tests need it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

FOX = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]


def write_adapter(root: Path, name: str = "step_1", rank: int = 8,
                  targets=("q_proj", "v_proj"), weights: bool = True) -> Path:
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
              "base_model_name_or_path": "sim/qwen2-tiny", "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    if weights:  # an empty safetensors file: 8-byte header length, then the JSON header
        header = b"{}      "
        (directory / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return directory


def greedy(tokens: int = 8, **extra) -> dict:
    return {"input_ids": FOX, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}, **extra}
