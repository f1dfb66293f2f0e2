"""A received bucket → what SGLang's `/update_weights_from_tensor` takes from one TP rank (torch, lazily).

SGLang 0.5.17 and 0.5.23 (`managers/tp_worker.py` `_deserialize_own_rank`, `utils/common.py`
`MultiprocessingSerializer`): `serialized_named_tensors[tp_rank]` is the base64 of a ForkingPickler pickle of
`[(name, tensor), ...]`; SGLang's SafeUnpickler allows torch's CUDA-IPC rebuild, and SGLang first patches it
(`utils/patch_torch.py` `monkey_patch_torch_reductions`) so that argument 6 of the rebuild args, the device, may be
a GPU UUID, which it maps to its own device index. So the payload puts the UUID there: right whatever
CUDA_VISIBLE_DEVICES each side has. The tensors are views of the received buffer (no copy); SGLang's
`_unwrap_tensor(...).to(device)` is a no-op on the rank's own GPU, and `load_weights` copies into the parameters —
the same copy count as vLLM's own receiver. The list-of-views form is used rather than `flattened_bucket`: its
metadata class would have to be pickled by SGLang's module path, and 0.5.23's bucket refuses unaligned offsets.

A view whose byte offset is not a multiple of its dtype's size cannot be made (vLLM's own consumer fails on it
too); such a tensor is copied into its own aligned buffer.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from token_proxy.bridge.wire import Bucket, Slot, itemsize

REBUILD_DEVICE_ARG = 6  # torch.multiprocessing.reductions.reduce_tensor's CUDA args: the device index


def slot_view(bucket: Bucket[Any], slot: Slot) -> Any:
    import torch

    buffer = bucket.buffers[slot.buffer]
    part = buffer[slot.start:slot.stop]
    if bucket.buffer_dtypes[slot.buffer] != slot.dtype:
        if (part.storage_offset() * part.element_size()) % itemsize(slot.dtype):
            part = part.clone()
        part = part.view(getattr(torch, slot.dtype))
    return part.view(slot.shape)


def named_views(bucket: Bucket[Any]) -> list[tuple[str, Any]]:
    return [(slot.name, slot_view(bucket, slot)) for slot in bucket.slots]


def _reduce_with_uuid(uuid: str):
    from torch.multiprocessing.reductions import reduce_tensor

    def reduce(tensor: Any):
        rebuild, args = reduce_tensor(tensor)
        if tensor.is_cuda:
            args = (*args[:REBUILD_DEVICE_ARG], uuid, *args[REBUILD_DEVICE_ARG + 1:])
        return rebuild, args

    return reduce


def ipc_payload(named: list[tuple[str, Any]], gpu_uuid: str) -> str:
    """One TP rank's entry of `serialized_named_tensors`: base64 of the pickle SGLang's MultiprocessingSerializer
    reads, with the producing GPU's UUID as the rebuild device."""
    from multiprocessing.reduction import ForkingPickler

    import torch

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    reduce = _reduce_with_uuid(gpu_uuid)
    table = dict(pickler.dispatch_table)
    table[torch.Tensor] = reduce
    table[torch.nn.Parameter] = reduce
    pickler.dispatch_table = table
    pickler.dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def gpu_uuid(gpu: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(gpu).uuid)
