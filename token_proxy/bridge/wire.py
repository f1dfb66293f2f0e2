"""The two trainer dialects' framing, as pure functions over a `Channel` (no torch here).

A receiving rank posts broadcasts in exactly the order the trainer sends them; a wrong size hangs NCCL or
loads garbage, so the order and sizes below are the upstream receivers' own (read in their sources):

- prime-rl (@559b447, `transports/weights/nccl.py` and its receiver `inference/vllm/worker/nccl.py`): an int64[1]
  chunk count, then per chunk an int64[1] pickle length, the pickle (uint8), and one flat buffer per dtype in the
  pickle's order: `{torch.dtype: [(name, torch.Size, numel), ...]}`.
- vLLM 0.33 (`distributed/weight_transfer/packed_tensor.py`, `nccl_engine.py`): the names, dtypes and shapes come
  over HTTP (`/update_weights`); packed, one uint8 broadcast per chunk, a chunk closed right after the tensor that
  takes its running byte total past `packed_buffer_size_bytes` (`packed_nccl_broadcast_consumer`); unpacked, one
  broadcast per tensor, in metadata order.

What a decoder yields is a `Bucket`: the buffers received for one unit that SGLang loads at once, and a `Slot` per
tensor (its element range in one buffer). `Slot.view` turns a slot into the tensor a receiver hands on.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from token_proxy.bridge.unpickle import read_primerl_metadata

# torch's dtype names (str(torch.bfloat16) without "torch.") and their sizes; the names both dialects use
DTYPE_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}
MAX_CHUNKS = 1 << 20  # prime-rl's chunk count is layers + 1; more is a corrupt stream, not a model
MAX_PICKLE_BYTES = 256 << 20  # one layer's metadata pickle


class WireError(ValueError):
    """The trainer's stream (or its metadata) is not what the dialect allows."""


@dataclass(frozen=True)  # pickled to the receiver processes (slots break that on 3.10)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class Slot:
    """One tensor inside a received buffer: elements [start, stop) of `bucket.buffers[buffer]`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    buffer: int
    start: int
    stop: int


B = TypeVar("B")


@dataclass(slots=True)
class Bucket(Generic[B]):
    """The buffers of one unit SGLang loads at once, their dtypes, and the tensors in them."""

    buffers: list[B] = field(default_factory=list)
    buffer_dtypes: list[str] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum((s.stop - s.start) * itemsize(self.buffer_dtypes[s.buffer]) for s in self.slots)


class Channel(Protocol[B]):
    """What a decoder needs from a receiving rank: post the next broadcast, and read a small buffer's bytes."""

    def recv(self, dtype: str, numel: int) -> B: ...

    def host_bytes(self, buffer: B) -> bytes: ...


def itemsize(dtype: str) -> int:
    try:
        return DTYPE_ITEMSIZE[dtype]
    except KeyError:
        raise WireError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_ITEMSIZE)}") from None


def _recv_int64(channel: Channel[Any]) -> int:
    raw = channel.host_bytes(channel.recv("int64", 1))
    if len(raw) != 8:
        raise WireError(f"an int64[1] broadcast came back as {len(raw)} bytes")
    return struct.unpack("<q", raw)[0]


def primerl_push(channel: Channel[B]) -> Iterator[Bucket[B]]:
    """One prime-rl push: a Bucket per state-dict chunk (the non-layer weights first, then each layer)."""
    count = _recv_int64(channel)
    if not 0 <= count <= MAX_CHUNKS:
        raise WireError(f"prime-rl's chunk count is {count}; expected 0..{MAX_CHUNKS}")
    for _ in range(count):
        size = _recv_int64(channel)
        if not 0 < size <= MAX_PICKLE_BYTES:
            raise WireError(f"prime-rl's metadata pickle is {size} bytes; expected 1..{MAX_PICKLE_BYTES}")
        groups = read_primerl_metadata(channel.host_bytes(channel.recv("uint8", size)))
        bucket: Bucket[B] = Bucket()
        for dtype, entries in groups:
            itemsize(dtype)
            offset = 0
            for name, shape, numel in entries:
                bucket.slots.append(Slot(name, dtype, shape, len(bucket.buffers), offset, offset + numel))
                offset += numel
            bucket.buffers.append(channel.recv(dtype, offset))
            bucket.buffer_dtypes.append(dtype)
        yield bucket


def metas_from_update_info(info: dict) -> list[TensorMeta]:
    """vLLM's `update_info` {names, dtype_names, shapes} → TensorMeta, checked as vLLM's dataclass checks it."""
    names, dtypes, shapes = info.get("names") or [], info.get("dtype_names") or [], info.get("shapes") or []
    if not (len(names) == len(dtypes) == len(shapes)):
        raise WireError(f"update_info: names, dtype_names and shapes differ in length "
                        f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    metas = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or not isinstance(shape, list | tuple) or \
                not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WireError(f"update_info: bad entry {name!r} {shape!r}")
        itemsize(dtype)
        metas.append(TensorMeta(name, dtype, tuple(shape)))
    return metas


def vllm_packed_chunks(metas: Sequence[TensorMeta], buffer_size_bytes: int) -> list[list[TensorMeta]]:
    """vLLM's consumer rule: add tensors until the running byte total exceeds the buffer size, then cut after
    that tensor (it stays in the chunk); what is left at the end is the last chunk."""
    chunks: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    total = 0
    for meta in metas:
        current.append(meta)
        total += meta.nbytes
        if total > buffer_size_bytes:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    return chunks


def vllm_push(channel: Channel[B], metas: Sequence[TensorMeta], *, packed: bool, buffer_size_bytes: int,
              ) -> Iterator[Bucket[B]]:
    """One vLLM push. Packed: a Bucket per chunk (one uint8 buffer; slots in bytes). Unpacked: the tensors,
    one broadcast each, grouped into Buckets by the same rule, so SGLang gets about as many calls either way."""
    for chunk in vllm_packed_chunks(metas, buffer_size_bytes):
        bucket: Bucket[B] = Bucket()
        if packed:
            offset = 0
            for meta in chunk:
                bucket.slots.append(Slot(meta.name, meta.dtype, meta.shape, 0, offset, offset + meta.nbytes))
                offset += meta.nbytes
            bucket.buffers.append(channel.recv("uint8", offset))
            bucket.buffer_dtypes.append("uint8")
        else:
            for meta in chunk:
                bucket.slots.append(Slot(meta.name, meta.dtype, meta.shape, len(bucket.buffers), 0, meta.numel))
                bucket.buffers.append(channel.recv(meta.dtype, meta.numel))
                bucket.buffer_dtypes.append(meta.dtype)
        yield bucket
