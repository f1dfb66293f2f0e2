"""Allowlisted unpicklers for what the bridge reads from the network (no torch needed).

Two pickles arrive from the trainer:
- the NCCL unique id, read from the trainer's TCPStore under `broadcast_from/0/0` (vLLM's
  `StatelessProcessGroup.broadcast_obj`). Two encodings exist in the wild: vLLM's and prime-rl's pickle the ctypes
  struct `vllm.distributed.device_communicators.pynccl_wrapper.ncclUniqueId` (reduced by ctypes to
  `_ctypes._unpickle(cls, (state_dict, 128 bytes))`); ART's vLLM-free sender pickles the 128 raw bytes.
- prime-rl's per-chunk metadata, `{torch.dtype: [(name, torch.Size, numel), ...]}`, sent inside the NCCL stream.

`find_class` answers only the names below; anything else (os.system, builtins.eval, ...) is refused before it is
looked up, so a hostile store or stream cannot run code in the bridge.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NCCL_UNIQUE_ID_BYTES = 128
UID_STORE_KEY = "broadcast_from/0/0"  # vLLM's StatelessProcessGroup: the first object broadcast from rank 0
VLLM_UID_CLASS = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")

# torch dtype names a prime-rl metadata pickle may name (the keys of wire.DTYPE_ITEMSIZE); kept here, not
# imported from wire, because wire imports this module
_TORCH_DTYPES = (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu", "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8",
    "bool", "complex64", "complex128",
)


class RefusedPickle(pickle.UnpicklingError):
    """A pickle from the network named something outside the allowlist, or had the wrong shape."""


class _Allowlisted(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: Mapping[tuple[str, str], Any]):
        super().__init__(io.BytesIO(data))
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise RefusedPickle(f"refused to unpickle {module}.{name}: not on the bridge's allowlist") from None


def _load(data: bytes, allowed: Mapping[tuple[str, str], Any]) -> Any:
    try:
        return _Allowlisted(data, allowed).load()
    except RefusedPickle:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated or corrupt pickle is one kind of refusal
        raise RefusedPickle(f"not a readable pickle: {exc}") from None


class _UidStruct:
    """Stands for vLLM's ncclUniqueId class inside the pickle; never instantiated."""


class _FromCtypes(bytes):
    """The id's bytes, marked as read from vLLM's ctypes struct."""


def _ctypes_unpickle(cls: Any, state: Any) -> bytes:
    if cls is not _UidStruct or not (isinstance(state, tuple) and len(state) == 2):
        raise RefusedPickle("a ctypes pickle that is not vLLM's ncclUniqueId")
    raw = state[1]
    if not isinstance(raw, bytes):
        raise RefusedPickle("ncclUniqueId's pickled state holds no bytes")
    return _FromCtypes(raw)


_UID_ALLOWED: Mapping[tuple[str, str], Any] = {("_ctypes", "_unpickle"): _ctypes_unpickle,
                                               VLLM_UID_CLASS: _UidStruct}


@dataclass(frozen=True, slots=True)
class UniqueId:
    raw: bytes  # the 128 bytes ncclCommInitRank takes
    encoding: str  # "vllm-ctypes" or "raw-bytes"


def read_unique_id(data: bytes) -> UniqueId:
    """The NCCL unique id from the store value under `broadcast_from/0/0`, in either encoding."""
    value = _load(data, _UID_ALLOWED)
    encoding = "vllm-ctypes" if isinstance(value, _FromCtypes) else "raw-bytes"
    if not isinstance(value, bytes | bytearray) or len(value) != NCCL_UNIQUE_ID_BYTES:
        got = f"{len(value)} bytes" if isinstance(value, bytes | bytearray) else type(value).__name__
        raise RefusedPickle(f"the NCCL unique id must be {NCCL_UNIQUE_ID_BYTES} bytes; the store held {got}")
    return UniqueId(bytes(value), encoding)


@dataclass(frozen=True, slots=True)
class _Dtype:
    name: str


def _size(dims: Any) -> tuple[int, ...]:
    return tuple(dims)


_META_ALLOWED: Mapping[tuple[str, str], Any] = {
    **{("torch", name): _Dtype(name) for name in _TORCH_DTYPES},
    ("torch", "Size"): _size,
}

Entry = tuple[str, tuple[int, ...], int]


def read_primerl_metadata(data: bytes) -> list[tuple[str, list[Entry]]]:
    """prime-rl's chunk metadata → [(dtype name, [(name, shape, numel), ...]), ...] in the pickle's order."""
    value = _load(data, _META_ALLOWED)
    if not isinstance(value, dict):
        raise RefusedPickle(f"prime-rl's metadata must be a dict, not {type(value).__name__}")
    groups = []
    for dtype, entries in value.items():
        if not isinstance(dtype, _Dtype) or not isinstance(entries, list):
            raise RefusedPickle(f"prime-rl's metadata key {dtype!r} is not a torch dtype with a list")
        groups.append((dtype.name, [_entry(e) for e in entries]))
    return groups


def _entry(entry: Any) -> Entry:
    ok = isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str) \
        and isinstance(entry[1], tuple) and all(isinstance(d, int) and d >= 0 for d in entry[1]) \
        and isinstance(entry[2], int)
    if not ok or math.prod(entry[1]) != entry[2]:
        raise RefusedPickle(f"prime-rl's metadata entry {entry!r} is not (name, shape, numel)")
    return entry
