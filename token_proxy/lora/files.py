"""An adapter directory checked before any worker sees it, with vLLM's status codes.

Files not there (yet) are vLLM's 404 "No adapter found" — prime-rl retries 404, which is what a step
directory that appears late on a network filesystem needs. An adapter SGLang cannot serve (malformed
config, rank above --max-lora-rank, modules outside --lora-target-modules) is a 400 naming the reason.
The limits come from the worker's /server_info, and are only checked when SGLang reports them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from token_proxy import checks as check
from token_proxy.errors import InvalidRequest, NotFound

CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# SGLang's get_normalized_target_modules: PEFT module names -> the fused weights its pool holds.
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj", "embeddings": "embed_tokens", "vocab_emb": "embed_tokens",
          "word_embeddings": "embed_tokens", "output": "lm_head", "unembed_tokens": "lm_head"}


@dataclass(frozen=True, slots=True)
class LoraLimits:
    """What one SGLang server was started with (None: not given, SGLang infers it)."""

    enabled: bool | None  # None: the server did not say
    max_rank: int | None
    target_modules: frozenset[str] | None  # normalized; {"all"} allows every module


def limits_of(server_info: dict) -> LoraLimits:
    targets = server_info.get("lora_target_modules")
    enabled = bool(server_info["enable_lora"]) if "enable_lora" in server_info else None
    return LoraLimits(enabled=enabled, max_rank=server_info.get("max_lora_rank"),
                      target_modules=normalized(targets) if targets else None)


def normalized(modules) -> frozenset[str]:
    if isinstance(modules, str):
        return frozenset({"all"}) if modules in ("all", "all-linear") else frozenset({modules})
    return frozenset(_FUSED.get(name.split(".")[-1], name.split(".")[-1]) for name in modules)


def not_found(name: str, path: str) -> NotFound:
    """vLLM's LoRAAdapterNotFoundError."""
    return NotFound(f"Loading lora {name} failed: No adapter found for {path}")


def checked_path(name: str, value, settings) -> str:
    """The path is a non-empty string, inside --weight-dir roots when set, and (when it looks local
    and the proxy may check paths) a directory holding a config and weights."""
    path = check.path(value, "lora_path")
    if settings.weight_dirs:
        if not check.looks_local(path):
            raise InvalidRequest("lora_path must be a path under the allowed weight directories, not a hub id",
                                 param="lora_path")
        check.inside_roots(path, "lora_path", settings.weight_dirs)
    if settings.check_local_paths and check.looks_local(path):
        directory = Path(path).expanduser()
        if not (directory / CONFIG).is_file() or not any((directory / f).is_file() for f in WEIGHT_FILES):
            raise not_found(name, path)
    return path


def read_config(name: str, path: str) -> dict:
    try:
        config = json.loads((Path(path).expanduser() / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"Loading lora {name} failed: {CONFIG} is not valid JSON: {exc}",
                             param="lora_path") from exc
    rank, targets = (config.get(key) if isinstance(config, dict) else None for key in ("r", "target_modules"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidRequest(f"Loading lora {name} failed: LoRA rank `r` must be a positive integer, got "
                             f"{rank!r}.", param="lora_path")
    if not targets or not isinstance(targets, (str, list)):
        raise InvalidRequest(f"Loading lora {name} failed: {CONFIG} has no target_modules", param="lora_path")
    return config


def check_fits(name: str, config: dict, limits: LoraLimits, worker: str) -> None:
    """SGLang's LoRAMemoryPool.can_support, as far as /server_info tells the proxy."""
    where = f" (SGLang at {worker})"
    if limits.enabled is False:
        raise InvalidRequest(f"Loading lora {name} failed: LoRA is not enabled{where}; start SGLang with "
                             "--enable-lora", param="lora_path")
    if limits.max_rank is not None and config["r"] > limits.max_rank:
        raise InvalidRequest(f"Loading lora {name} failed: LoRA rank {config['r']} is greater than "
                             f"max_lora_rank {limits.max_rank}{where}.", param="lora_path")
    wanted = normalized(config["target_modules"])
    allowed = limits.target_modules
    if allowed is not None and "all" not in allowed and "all" not in wanted and not wanted <= allowed:
        raise InvalidRequest(
            f"Loading lora {name} failed: target modules {sorted(wanted - allowed)} are not in SGLang's "
            f"--lora-target-modules {sorted(allowed)}{where}.", param="lora_path")
