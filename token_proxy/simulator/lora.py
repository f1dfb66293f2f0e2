"""SGLang 0.5.17's LoRA adapters: /load_lora_adapter, /unload_lora_adapter and /generate's lora_path,
with its messages and status codes (tokenizer_control_mixin.py, lora_manager.py, lora_registry.py,
tokenizer_manager._resolve_lora_path).

An adapter changes the fake model's output deterministically (its path joins the weight key), so a test
at temperature 0 tells base from adapter, and one adapter step from the next.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

from token_proxy.simulator.errors import BadRequest

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
# SGLang's get_normalized_target_modules, for the memory pool's can_support.
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


@dataclass(frozen=True)
class LoraPool:
    """--enable-lora, --max-lora-rank, --lora-target-modules (None: SGLang infers; no check here)."""

    enabled: bool = True
    max_rank: int | None = None
    target_modules: tuple[str, ...] | None = None


@dataclass
class SimLora:
    loaded: dict[str, str] = field(default_factory=dict)  # the registry: name -> path, load order
    # TokenizerManager.lora_ref_cache: every name ever loaded; a request naming an unloaded one re-loads it.
    ever_loaded: dict[str, str] = field(default_factory=dict)

    def load(self, name: str, path: str, pool: LoraPool) -> str | None:
        """The scheduler's LoRAManager.load_lora_adapter: None, or SGLang's error message."""
        try:
            config = _read_config(path)
            rank, targets = config["r"], config["target_modules"]
        except (OSError, ValueError, KeyError) as exc:
            return str(exc)
        if name in self.loaded:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        if not _fits(rank, targets, pool):
            return (f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
                    "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        self.loaded[name] = self.ever_loaded[name] = path
        return None

    def unregister(self, name: str) -> str | None:
        if name not in self.loaded:
            return f"LoRA with name {name} does not exist. Loaded LoRAs: odict_keys({list(self.loaded)!r})"
        del self.loaded[name]
        return None

    def resolve(self, name: str, pool: LoraPool) -> str:
        """_resolve_lora_path: the adapter's path, re-loading one that was unloaded, else SGLang's 400."""
        if name not in self.loaded:
            if name not in self.ever_loaded:
                raise BadRequest(f"Got LoRA adapter that has never been loaded: {name}\n"
                                 f"All loaded adapters: dict_keys({list(self.ever_loaded)!r}).")
            error = self.load(name, self.ever_loaded[name], pool)
            if error is not None and "already loaded" not in error:
                raise BadRequest(f"Failed to implicitly load LoRA adapter {name}: {error}")
        return self.loaded[name]

    def cards(self, parent: str, created: int) -> list[dict]:
        """/v1/models' adapter cards."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "sglang", "root": path,
                 "parent": parent, "max_model_len": None} for name, path in self.loaded.items()]


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):  # SGLang asks the Hugging Face Hub (snapshot_download), which refuses it
        raise ValueError(f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. "
                         "Use `repo_type` argument if needed.")
    with open(os.path.join(path, "adapter_config.json")) as f:
        return json.load(f)


def _fits(rank: int, targets, pool: LoraPool) -> bool:
    if pool.max_rank is not None and rank > pool.max_rank:
        return False
    if pool.target_modules is None or "all" in pool.target_modules or isinstance(targets, str):
        return True
    allowed = {_FUSED.get(m, m) for m in pool.target_modules}
    return {_FUSED.get(m.split(".")[-1], m.split(".")[-1]) for m in targets} <= allowed


def with_adapters(lora: SimLora, pool: LoraPool, body: dict, call):
    """The call's sequences, each with the (name, path) of its adapter (lora_path: one, or one per item)."""
    raw = body.get("lora_path")
    if not raw:
        return call
    if not (isinstance(raw, str) or (isinstance(raw, list) and all(x is None or isinstance(x, str) for x in raw))):
        raise BadRequest("lora_path should be a list or a string.")
    if not pool.enabled:
        first = raw if isinstance(raw, str) else next((a for a in raw if a), None)
        raise BadRequest(f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the "
                         "server with --enable-lora flag and preload adapters using --lora-paths or "
                         "/load_lora_adapter endpoint.")
    paths = {name: lora.resolve(name, pool) for name in ([raw] if isinstance(raw, str) else raw) if name}
    n = len(call.sequences) // len({s.logical_rid for s in call.sequences})

    def adapter_of(spec):
        name = raw if isinstance(raw, str) else (raw[spec.index // n] if spec.index // n < len(raw) else None)
        return (name, paths[name]) if name else None

    return replace(call, sequences=[replace(s, lora=adapter_of(s)) for s in call.sequences])


def weight_key(base_key: str, adapter: tuple[str, str] | None) -> str:
    return base_key if adapter is None else f"{base_key}\0lora\0{adapter[1]}"


def pool_of(config) -> LoraPool:
    return LoraPool(config.enable_lora, config.max_lora_rank, config.lora_target_modules)
