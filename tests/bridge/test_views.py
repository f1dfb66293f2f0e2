"""The tensors a receiver hands SGLang (handoff.named_views) are views of the received buffers with the
recorded bytes, dtypes and shapes: the recorded streams replayed into torch buffers (CPU; CI's torch step)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.bridge.streams import ReplayChannel, recording
from token_proxy.bridge.handoff import named_views, slot_view
from token_proxy.bridge.receiver import PushSpec, buckets_of
from token_proxy.bridge.wire import Bucket, Slot, metas_from_update_info


class TorchReplay(ReplayChannel):
    """Buffers as torch tensors of the posted dtype, filled with the recorded bytes (as NCCL would)."""

    def recv(self, dtype, numel):
        raw = super().recv(dtype, numel)
        buffer = torch.empty(numel, dtype=getattr(torch, dtype))
        buffer.view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        return buffer

    def host_bytes(self, buffer):
        return bytes(buffer.view(torch.uint8).tolist())


def as_bytes(t) -> bytes:
    return bytes(t.contiguous().view(-1).view(torch.uint8).tolist())


@pytest.mark.parametrize("stem", ["primerl", "vllm_packed", "vllm_unpacked"])
def test_views_hold_the_sent_tensors(stem):
    rec = recording(stem)
    spec = PushSpec("primerl") if stem == "primerl" else PushSpec(
        "vllm", tuple(metas_from_update_info(rec.doc["update_info"])), rec.doc["init_info"]["packed"],
        rec.doc["init_info"]["packed_buffer_size_bytes"])
    got = []
    for bucket in buckets_of(spec, TorchReplay(rec)):
        for name, view in named_views(bucket):
            assert view.untyped_storage().data_ptr() == bucket.buffers[0].untyped_storage().data_ptr() or \
                len(bucket.buffers) > 1  # a view, not a copy
            got.append((name, str(view.dtype).removeprefix("torch."), tuple(view.shape), as_bytes(view)))
    assert got == rec.expected()


def test_an_unaligned_tensor_is_copied_into_its_own_buffer():
    buffer = torch.arange(10, dtype=torch.uint8)
    bucket = Bucket([buffer], ["uint8"], [Slot("odd", "bfloat16", (2,), 0, 1, 5)])
    view = slot_view(bucket, bucket.slots[0])
    assert view.dtype == torch.bfloat16
    assert as_bytes(view) == bytes([1, 2, 3, 4])
    assert view.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()


def test_ipc_payload_is_a_forking_pickle_of_the_named_tensors():
    """The payload's shape as SGLang's MultiprocessingSerializer reads it: base64 of a ForkingPickler pickle of
    [(name, tensor)]. On CPU torch shares the storage through a file descriptor; the CUDA path (the UUID at
    the rebuild's device argument) is the GPU round's."""
    import base64
    import pickle

    from token_proxy.bridge.handoff import ipc_payload

    t = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    (name, back), = pickle.loads(base64.b64decode(ipc_payload([("w", t[1:])], "GPU-0")))
    assert name == "w"
    assert torch.equal(back, t[1:])
