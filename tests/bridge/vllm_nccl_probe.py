"""Run as a script (tests/bridge/test_upstream_vllm_nccl.py does, in a fresh interpreter: enter_vllm fills
sys.modules): vLLM 0.33's own NCCLLibrary and PyNcclCommunicator, unmodified, against a stand-in libnccl that
exports every symbol vLLM binds except `absent` (NCCL 2.28.9 lacks ncclCommSuspend/ncclCommResume). Prints one JSON
line: what vLLM did before and after upstream.fit_vllm_nccl's filter.

    python tests/bridge/vllm_nccl_probe.py VLLM_ENGINE_SRC ABSENT[,ABSENT]
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

sys.path.insert(0, os.getcwd())
from tests.bridge import upstream


class Reached(Exception):
    """The stand-in's ncclCommInitRank: the communicator got as far as creating the NCCL communicator."""


class Fn:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls
        self.restype = self.argtypes = None

    def __call__(self, *args):
        self.calls.append(self.name)
        if self.name == "ncclGetVersion":
            args[0]._obj.value = 22809  # 2.28.9, the GPU host's
        elif self.name == "ncclGetUniqueId":
            ctypes.memmove(ctypes.addressof(args[0]._obj), b"\x07" * 128, 128)
        elif self.name == "ncclCommInitRank":
            raise Reached
        elif self.name == "ncclGetErrorString":
            return b"stand-in"
        return 0


class Lib:
    def __init__(self, absent: set[str]):
        self.absent, self.calls = absent, []

    def __getattr__(self, name: str):
        if name.startswith("nccl") and name not in self.absent:
            fn = Fn(name, self.calls)
            object.__setattr__(self, name, fn)
            return fn
        raise AttributeError(name)


class Store:
    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value

    def get(self, key):
        return self.values[key]


def communicator(lib_path: str):
    """PyNcclCommunicator as the trainer opens it: rank 0 of a StatelessProcessGroup of 2 (a dict for a store)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    store = Store()
    group = StatelessProcessGroup(rank=0, world_size=2, store=store)
    try:
        comm = PyNcclCommunicator(group, device="cpu", library_path=lib_path)  # no CUDA here
    except Reached:
        from token_proxy.bridge.unpickle import UID_STORE_KEY, read_unique_id

        uid = read_unique_id(store.values[UID_STORE_KEY])  # the bridge's allowlisted reader, on vLLM's own pickle
        return {"published_id": list(store.values), "reached_comm_init_rank": True, "uid_encoding": uid.encoding,
                "uid_is_the_librarys": uid.raw == b"\x07" * 128}
    return {"published_id": list(store.values), "available": comm.available, "disabled": comm.disabled}


def main() -> None:
    root, absent = sys.argv[1], set(filter(None, sys.argv[2].split(",")))
    upstream.enter_vllm(root)
    lib = Lib(absent)
    ctypes.CDLL = lambda path, *a, **k: lib  # vLLM's NCCLLibrary loads the stand-in
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    out = {}
    try:
        NCCLLibrary("stand-in.so")
        out["library_before"] = "ok"
    except Exception as exc:  # noqa: BLE001 - what vLLM raises is the finding
        out["library_before"] = f"{type(exc).__name__}: {exc}"
    out["before"] = communicator("stand-in.so")
    NCCLLibrary.path_to_library_cache.clear()
    NCCLLibrary.path_to_dict_mapping.clear()
    out["dropped"] = upstream.fit_vllm_nccl("stand-in.so")
    try:
        library = NCCLLibrary("stand-in.so")
    except Exception as exc:  # noqa: BLE001 - a symbol the transfer needs is still a loud failure
        out["library_after"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(out))
        return
    out["library_after"] = "ok"
    out["has_suspend"] = library.has_symbol("ncclCommSuspend")
    out["bound"] = sorted(library._funcs)
    out["after"] = communicator("stand-in.so")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
