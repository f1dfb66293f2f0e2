"""A ctypes binding of the libnccl.so.2 that torch loaded: the calls a weight receiver (and the GPU round's trainer
stand-in) make, with the argument types of NCCL's `nccl.h` as vLLM 0.33's own ctypes binding declares them
(`distributed/device_communicators/pynccl_wrapper.py`, which PyNcclCommunicator, the trainers' sender, runs on).

Why not `torch.cuda.nccl`: torch 2.11's `_nccl_init_rank` parses the 128-byte id with the "s#" format without
PY_SSIZE_T_CLEAN, so `torch.cuda.nccl.init_rank` raises "SystemError: PY_SSIZE_T_CLEAN macro must be defined for
'#' formats" on every Python >= 3.10 (seen on the GPU host: torch 2.11.0+cu130, Python 3.12). Why not cupy's nccl:
a large extra wheel for five calls, and vLLM's sender itself is this very kind of ctypes binding.

Which library: `$TOKEN_PROXY_NCCL_SO` when set (as vLLM's VLLM_NCCL_SO_PATH); else the libnccl already mapped into
this process (torch's, once torch is imported); else the nvidia-nccl wheel's copy on sys.path (what torch's wheel
links); else the loader's `libnccl.so.2`. The dynamic loader hands back the library already loaded for the same
file, so torch and this binding share one NCCL. No torch here: callers pass pointers, counts and dtype names.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

ENV_SO = "TOKEN_PROXY_NCCL_SO"
SONAME = "libnccl.so.2"

# nccl.h's ncclResult_t, ncclComm_t, cudaStream_t, void*, ncclDataType_t, ncclRedOp_t
Result = ctypes.c_int
Comm = ctypes.c_void_p
Stream = ctypes.c_void_p
Buffer = ctypes.c_void_p
DataType = ctypes.c_int
RedOp = ctypes.c_int
SUM = 0  # ncclSum


class UniqueId(ctypes.Structure):
    """ncclUniqueId: 128 opaque bytes, passed by value to ncclCommInitRank."""

    _fields_ = [("internal", ctypes.c_byte * 128)]


# nccl.h's DataType for the dtypes vLLM's PyNccl maps (its ncclDataTypeEnum.from_torch), by torch's names
NCCL_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7,
               "float64": 8, "bfloat16": 9, "float8_e4m3fn": 10}

# (name, restype, argtypes, required); nccl.h's prototypes, the same types as vLLM 0.33's pynccl_wrapper
FUNCTIONS: list[tuple[str, Any, list[Any], bool]] = [
    ("ncclGetErrorString", ctypes.c_char_p, [Result], True),
    ("ncclGetLastError", ctypes.c_char_p, [Comm], False),
    ("ncclGetVersion", Result, [ctypes.POINTER(ctypes.c_int)], True),
    ("ncclGetUniqueId", Result, [ctypes.POINTER(UniqueId)], True),
    ("ncclCommInitRank", Result, [ctypes.POINTER(Comm), ctypes.c_int, UniqueId, ctypes.c_int], True),
    ("ncclAllReduce", Result,
     [Buffer, Buffer, ctypes.c_size_t, DataType, RedOp, Comm, Stream], True),
    ("ncclBroadcast", Result,
     [Buffer, Buffer, ctypes.c_size_t, DataType, ctypes.c_int, Comm, Stream], True),
    ("ncclCommAbort", Result, [Comm], True),
]


class NcclError(RuntimeError):
    """An NCCL call failed, or the library could not be loaded; the message is the one line to show."""


def find_library(environ: Mapping[str, str] = os.environ, maps: str = "/proc/self/maps",
                 paths: Iterable[str] | None = None) -> tuple[str, str]:
    """(the library to load, where it was found): see the module's docstring for the order."""
    if environ.get(ENV_SO):
        return environ[ENV_SO], ENV_SO
    loaded = _mapped_nccl(maps)
    if loaded:
        return loaded, "loaded in this process"
    for entry in sys.path if paths is None else paths:
        for pattern in ("nvidia/nccl/lib/libnccl.so*", "nvidia/cu*/lib/libnccl.so*", "torch/lib/libnccl.so*"):
            found = sorted(glob.glob(os.path.join(entry, pattern)))
            if found:
                return found[0], "nvidia-nccl wheel"
    return SONAME, "the dynamic loader"


def _mapped_nccl(maps: str) -> str | None:
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(None, 5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if os.path.basename(path).startswith("libnccl.so"):
                    return path
    except OSError:
        return None
    return None


def wire_type(dtype: str, numel: int, itemsize: int) -> tuple[int, int]:
    """(DataType, count) for a buffer of `numel` `dtype`s: NCCL's own type where it has one (as vLLM's PyNccl
    sends), else the bytes as uint8 (a broadcast copies bytes; PyNccl itself refuses such dtypes)."""
    if dtype in NCCL_DTYPES:
        return NCCL_DTYPES[dtype], numel
    return NCCL_DTYPES["uint8"], numel * itemsize


class Nccl:
    """The loaded library with its prototypes set; every call checks its result (NcclError with NCCL's words)."""

    def __init__(self, path: str | None = None, cdll: Callable[[str], Any] = ctypes.CDLL):
        self.path, self.found_by = (path, "given") if path else find_library()
        try:
            self.lib = cdll(self.path)
        except OSError as exc:
            raise NcclError(f"could not load NCCL from {self.path} ({self.found_by}): {exc}; set {ENV_SO} to the "
                            f"libnccl.so.2 your torch uses (site-packages/nvidia/nccl/lib/libnccl.so.2)") from exc
        self.fns: dict[str, Any] = {}
        for name, restype, argtypes, required in FUNCTIONS:
            try:
                fn = getattr(self.lib, name)
            except AttributeError:
                if required:
                    raise NcclError(f"{self.path} has no {name}: not an NCCL 2.x library; set {ENV_SO}") from None
                continue
            fn.restype, fn.argtypes = restype, argtypes
            self.fns[name] = fn

    def check(self, result: int, call: str) -> None:
        if result == 0:
            return
        text = self.fns["ncclGetErrorString"](result)
        message = f"{call}: NCCL error {result}: {text.decode(errors='replace') if text else 'unknown'}"
        if "ncclGetLastError" in self.fns:
            last = self.fns["ncclGetLastError"](None)
            if last:
                message += f" ({last.decode(errors='replace').strip()})"
        raise NcclError(message)

    def raw_version(self) -> int:
        version = ctypes.c_int()
        self.check(self.fns["ncclGetVersion"](ctypes.byref(version)), "ncclGetVersion")
        return version.value

    def version(self) -> str:
        """"2.28.9" from 22809 (NCCL >= 2.9's encoding, major*10000 + minor*100 + patch)."""
        raw = self.raw_version()
        return f"{raw // 10000}.{raw // 100 % 100}.{raw % 100}"

    def unique_id(self) -> UniqueId:
        uid = UniqueId()
        self.check(self.fns["ncclGetUniqueId"](ctypes.byref(uid)), "ncclGetUniqueId")
        return uid

    @staticmethod
    def unique_id_from(raw: bytes) -> UniqueId:
        if len(raw) != ctypes.sizeof(UniqueId):
            raise NcclError(f"an NCCL unique id is {ctypes.sizeof(UniqueId)} bytes, got {len(raw)}")
        uid = UniqueId()
        ctypes.memmove(ctypes.addressof(uid), raw, len(raw))
        return uid

    def init_rank(self, world_size: int, uid: UniqueId, rank: int) -> ctypes.c_void_p:
        """ncclCommInitRank on the calling thread's current CUDA device; blocks until all ranks joined."""
        comm = Comm()
        self.check(self.fns["ncclCommInitRank"](ctypes.byref(comm), world_size, uid, rank), "ncclCommInitRank")
        return comm

    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: Any, stream: int) -> None:
        self.check(self.fns["ncclAllReduce"](Buffer(send), Buffer(recv), count, dtype, op, comm,
                                             Stream(stream)), "ncclAllReduce")

    def broadcast(self, send: int | None, recv: int, count: int, dtype: int, root: int, comm: Any,
                  stream: int) -> None:
        """ncclBroadcast; a non-root rank passes send=None (as vLLM's PyNccl), the root the same pointer twice."""
        self.check(self.fns["ncclBroadcast"](Buffer(send), Buffer(recv), count, dtype, root, comm,
                                             Stream(stream)), "ncclBroadcast")

    def abort(self, comm: Any) -> None:
        """Frees the communicator without waiting for the peers (safe when they are gone, unlike ncclCommDestroy)."""
        self.check(self.fns["ncclCommAbort"](comm), "ncclCommAbort")
