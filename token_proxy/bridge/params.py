"""What SGLang would refuse, checked by the bridge before SGLang sees it: each received tensor's name and shape
against the served checkpoint's own table (its safetensors headers, read once at start; no torch).

Why the bridge checks (SGLang 0.5.17, read in its source): `/update_weights_from_tensor` refuses nothing itself.
`ModelRunner.update_weights_from_tensor` calls the model's `load_weights` with no try/except; Qwen2's legacy
loader logs "Parameter X not found in params_dict" for an unknown name and answers success (the tensor is dropped
silently), and a wrong shape fails `default_weight_loader`'s (or the fused loaders') shape assertion, which
propagates out of the scheduler's request dispatcher and takes the scheduler, hence the server, down. A dtype that
differs is not checked: SGLang's loaders `copy_` it into the parameter's dtype, as they do a checkpoint's.

The table is the checkpoint's names and shapes (the trainer sends checkpoint names at full size whatever SGLang's
tensor parallelism), so it is right for every TP rank. A model that is not a local directory of safetensors (a
hub id SGLang downloaded elsewhere) has no table: nothing is checked, and the bridge says so at start.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

HEADER_LIMIT = 100 << 20  # safetensors' own cap on the JSON header


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """One safetensors file's tensor names and shapes, from its header (8-byte little-endian length, then JSON)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > HEADER_LIMIT:
            raise ValueError(f"{path}: a header of {length} bytes is not safetensors")
        header = json.loads(f.read(length))
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """Every tensor of the checkpoint in `model_dir`, or None when it is not a local safetensors checkpoint."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    table: dict[str, tuple[int, ...]] = {}
    for path in files:
        table.update(safetensors_shapes(path))
    if TIED_HEAD not in table and TIED_EMBEDDING in table and _tied(Path(model_dir)):
        # a tied model's checkpoint has no lm_head.weight, but a trainer's state_dict() does (prime-rl sends it);
        # SGLang's tied model drops it, harmlessly: it holds the embedding's values, which come too
        table[TIED_HEAD] = table[TIED_EMBEDDING]
    return table


TIED_HEAD, TIED_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def _tied(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return True  # transformers' default
    return bool(config.get("tie_word_embeddings", True))


def refusal(table: dict[str, tuple[int, ...]] | None, tensors: Iterable[tuple[str, tuple[int, ...]]]) -> str:
    """Why SGLang must not be given these (name, shape)s: the first one it has no parameter for, or whose shape
    differs from its parameter's; "" when all fit (or there is no table to check against)."""
    if table is None:
        return ""
    for name, shape in tensors:
        if name not in table:
            return (f"refused by the weight bridge: SGLang has no parameter {name} (SGLang 0.5.17 would drop it "
                    "with only a log warning)")
        if tuple(shape) != table[name]:
            return (f"refused by the weight bridge: {name} has shape {list(shape)}, SGLang's is "
                    f"{list(table[name])} (SGLang 0.5.17's loader would fail its shape assertion and stop)")
    return ""
