"""The bridge's check before SGLang (bridge/params.py): the served checkpoint's table from its safetensors headers,
and the first tensor SGLang 0.5.17 would drop (unknown name) or crash on (other shape)."""

from __future__ import annotations

import json
import math
import struct

import pytest

from token_proxy.bridge.params import checkpoint_shapes, refusal, safetensors_shapes


def write_header(path, tensors: dict[str, list[int]]) -> None:
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))


def test_a_sharded_checkpoint_is_one_table(tmp_path):
    write_header(tmp_path / "model-00001-of-00002.safetensors", {"model.embed_tokens.weight": [64, 16]})
    write_header(tmp_path / "model-00002-of-00002.safetensors", {"model.norm.weight": [16], "lm_head.weight": [64, 16]})
    assert checkpoint_shapes(str(tmp_path)) == {"model.embed_tokens.weight": (64, 16), "model.norm.weight": (16,),
                                                "lm_head.weight": (64, 16)}


@pytest.mark.parametrize(("tied", "head"), [(True, (64, 16)), (False, None)])
def test_a_tied_models_head_is_taken_as_the_embedding(tmp_path, tied, head):
    """prime-rl sends its state_dict's lm_head.weight, which a tied checkpoint lacks and SGLang drops harmlessly."""
    write_header(tmp_path / "model.safetensors", {"model.embed_tokens.weight": [64, 16]})
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    assert checkpoint_shapes(str(tmp_path)).get("lm_head.weight") == head


@pytest.mark.parametrize("model_path", ["Qwen/Qwen3-0.6B", ""])
def test_a_model_that_is_no_local_checkpoint_has_no_table_and_nothing_is_refused(model_path):
    assert checkpoint_shapes(model_path) is None
    assert refusal(None, [("anything", (1,))]) == ""


def test_a_file_that_is_not_safetensors_is_refused_by_its_header_length(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="is not safetensors"):
        safetensors_shapes(tmp_path / "model.safetensors")


TABLE = {"model.norm.weight": (16,), "model.layers.0.mlp.down_proj.weight": (16, 40)}


@pytest.mark.parametrize(("tensors", "reason"), [
    ([("model.norm.weight", (16,)), ("model.layers.0.mlp.down_proj.weight", (16, 40))], ""),
    ([("model.norm.weight", (16,)), ("model.layers.0.mlp.down_prj.weight", (16, 40))],
     ("refused by the weight bridge: SGLang has no parameter model.layers.0.mlp.down_prj.weight (SGLang 0.5.17 "
     "would drop it with only a log warning)")),
    ([("model.layers.0.mlp.down_proj.weight", (640,))],
     ("refused by the weight bridge: model.layers.0.mlp.down_proj.weight has shape [640], SGLang's is [16, 40] "
     "(SGLang 0.5.17's loader would fail its shape assertion and stop)")),
])
def test_the_first_tensor_sglang_cannot_take_is_named(tensors, reason):
    assert refusal(TABLE, tensors) == reason
