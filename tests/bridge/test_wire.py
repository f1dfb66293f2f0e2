"""The bridge's decoders against streams recorded from the real senders (prime-rl@559b447, vLLM 0.33): every
(name, tensor) back bit-exact, and the broadcasts posted (the chunk boundaries) equal to the upstream receivers'."""

from __future__ import annotations

import pickle

import pytest

from tests.bridge.streams import ReplayChannel, recording
from token_proxy.bridge.wire import (
    Bucket,
    TensorMeta,
    WireError,
    itemsize,
    metas_from_update_info,
    primerl_push,
    vllm_packed_chunks,
    vllm_push,
)


def decoded(buckets: list[Bucket]) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    return [(s.name, s.dtype, s.shape, slot_bytes(b, s)) for b in buckets for s in b.slots]


def slot_bytes(bucket: Bucket, slot) -> bytes:
    """A slot's raw bytes in its buffer (the replay's buffers are bytes; the GPU path makes views instead)."""
    size = itemsize(bucket.buffer_dtypes[slot.buffer])
    return bucket.buffers[slot.buffer][slot.start * size:slot.stop * size]


def test_primerl_stream_decodes_bit_exact_with_prime_rls_own_receive_order():
    rec = recording("primerl")
    channel = ReplayChannel(rec)
    buckets = list(primerl_push(channel))
    assert channel.finished()
    assert channel.posted == rec.doc["consumer"]["posted"]  # what prime-rl's receiver posts, in order
    assert decoded(buckets) == rec.expected()
    assert len(buckets) == rec.doc["layers"] + 1  # the non-layer weights, then one bucket per layer
    assert [s.name for s in buckets[0].slots] == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    assert buckets[0].buffer_dtypes == ["bfloat16", "float32"]


@pytest.mark.parametrize("stem", ["vllm_packed", "vllm_unpacked"])
def test_vllm_stream_decodes_bit_exact(stem):
    rec = recording(stem)
    init = rec.doc["init_info"]
    metas = metas_from_update_info(rec.doc["update_info"])
    channel = ReplayChannel(rec)
    buckets = list(vllm_push(channel, metas, packed=init["packed"], buffer_size_bytes=init["packed_buffer_size_bytes"]))
    assert channel.finished()
    assert decoded(buckets) == rec.expected()
    assert rec.doc["calls"] == ["start_weight_update", "update_weights", "finish_weight_update"]


def test_vllm_packed_chunks_equal_vllms_consumer():
    rec = recording("vllm_packed")
    metas = metas_from_update_info(rec.doc["update_info"])
    chunks = vllm_packed_chunks(metas, rec.doc["init_info"]["packed_buffer_size_bytes"])
    assert [[m.name for m in c] for c in chunks] == rec.doc["consumer"]["chunks"]
    assert [["uint8", sum(m.nbytes for m in c)] for c in chunks] == rec.doc["consumer"]["posted"]
    # the recording crosses boundaries both ways: a lone tensor over the buffer, and a chunk closed mid-layer
    assert [len(c) for c in chunks] == [1, 4, 4, 2]


def test_vllm_chunk_rule_keeps_the_tensor_that_crosses():
    metas = [TensorMeta(f"t{i}", "uint8", (n,)) for i, n in enumerate([4, 4, 3, 10, 1])]
    assert [[m.name for m in c] for c in vllm_packed_chunks(metas, 8)] == [["t0", "t1", "t2"], ["t3"], ["t4"]]
    assert [[m.name for m in c] for c in vllm_packed_chunks(metas, 100)] == [["t0", "t1", "t2", "t3", "t4"]]
    assert vllm_packed_chunks([], 8) == []


def test_update_info_refusals():
    with pytest.raises(WireError, match="differ in length"):
        metas_from_update_info({"names": ["a"], "dtype_names": [], "shapes": [[1]]})
    with pytest.raises(WireError, match="unknown dtype 'float4'"):
        metas_from_update_info({"names": ["a"], "dtype_names": ["float4"], "shapes": [[1]]})
    with pytest.raises(WireError, match="bad entry"):
        metas_from_update_info({"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[-1]]})


class _Ints:
    """A channel over hand-made broadcasts (for the refusals)."""

    def __init__(self, *buffers: bytes):
        self.buffers = list(buffers)

    def recv(self, dtype, numel):
        return self.buffers.pop(0)

    def host_bytes(self, b):
        return b


def test_primerl_refuses_a_corrupt_stream():
    with pytest.raises(WireError, match="chunk count is -1"):
        list(primerl_push(_Ints((-1).to_bytes(8, "little", signed=True))))
    with pytest.raises(WireError, match="pickle is 0 bytes"):
        list(primerl_push(_Ints((1).to_bytes(8, "little"), (0).to_bytes(8, "little"))))
    evil = pickle.dumps({"x": 1})
    with pytest.raises(pickle.UnpicklingError, match="not a torch dtype"):
        list(primerl_push(_Ints((1).to_bytes(8, "little"), len(evil).to_bytes(8, "little"), evil)))
