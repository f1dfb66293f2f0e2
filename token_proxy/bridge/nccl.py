"""Joining the trainer's NCCL group exactly as vLLM's receiver does (torch imported lazily, in the receiver process).

vLLM's and prime-rl's receivers (`StatelessProcessGroup.create` + `PyNcclCommunicator`, vLLM 0.33
`distributed/utils.py` and `device_communicators/pynccl.py`; the same in 0.26, prime-rl's pin) do, in order:
1. a TCPStore client of the trainer's store, counted in its world (`world_size=W`, the default wait_for_workers);
2. the unique id from `broadcast_from/0/0` (unpickled here through the allowlist, either encoding);
3. `ncclCommInitRank(W, uid, rank)`;
4. a warm-up all-reduce of one float32 zero (SUM), then a stream synchronize. The trainer's constructor blocks
   in its own warm-up until every rank has joined it.

The binding is `libnccl.Nccl`, a ctypes binding of the libnccl.so.2 torch loaded (found as vLLM's
`find_nccl_library` finds it; `$TOKEN_PROXY_NCCL_SO` overrides, as vLLM's VLLM_NCCL_SO_PATH), the same kind of
binding as the trainer's PyNccl, so both sides run the NCCL their torch ships. Not `torch.cuda.nccl`: torch 2.11's
`init_rank` parses the id with "s#" without PY_SSIZE_T_CLEAN and raises "SystemError: PY_SSIZE_T_CLEAN macro must
be defined for '#' formats" on Python >= 3.10 (the GPU host's first 2-GPU round). Not cupy's nccl: a large wheel
the hosts need not carry, for five calls. The broadcast is `ncclBroadcast` with root 0 (the trainer's rank) and no
send buffer, as PyNccl's receiving side calls it. So the bridge's NCCL is its torch's: pin the trainer's torch (or
nvidia-nccl-cuXX) in the bridge's environment.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from token_proxy.bridge.libnccl import SUM, Nccl, NcclError, wire_type
from token_proxy.bridge.unpickle import UID_STORE_KEY, read_unique_id
from token_proxy.bridge.wire import itemsize


class JoinError(RuntimeError):
    """The receiving rank could not join the trainer's group; the message is the one line to show."""


@dataclass(frozen=True)  # pickled to the receiver processes (slots break that on 3.10)
class JoinSpec:
    host: str
    port: int
    world_size: int
    rank: int
    gpu: int  # the device index this process sees
    timeout_s: float


# The trainer's rank 0 (vLLM's StatelessProcessGroup.create, the TCPStore master) is released once every rank has
# joined its store, and its PyNcclCommunicator then publishes the id at once. torch's own count of the joined
# (TCPStore's "init/") is not readable through the store's API, so each bridge rank adds itself under this key of
# the trainer's store (a key vLLM and prime-rl never read); all receiving ranks in = rank 0 was released.
JOINED_KEY = "token_proxy.bridge/joined"
UID_GRACE_S = 30.0  # from the last rank's arrival: ncclGetUniqueId takes well under a second


def no_unique_id(spec: JoinSpec, grace_s: float, bridge_nccl: str) -> str:
    """The one line for a trainer whose rank 0 was released but never published its NCCL id."""
    return (f"rank {spec.rank}: every receiving rank has joined the trainer's store at {spec.host}:{spec.port}, "
            f"but the trainer published no NCCL id within {grace_s:g} s: its PyNcclCommunicator turned itself off, "
            f"which vLLM does without a word when NCCLLibrary() fails in the trainer's process. Usual causes: the "
            f"trainer's libnccl lacks a symbol its vLLM binds (vLLM 0.33 binds ncclCommSuspend, NCCL >= 2.29.7: "
            f"torch >= 2.14 or nvidia-nccl-cu13 >= 2.29.7; torch 2.11 ships 2.28.9), VLLM_NCCL_SO_PATH names no "
            f"NCCL, VLLM_DISABLE_PYNCCL=1, or vLLM's pyzmq is missing. Check in the trainer's environment: python -c "
            f"'from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary; NCCLLibrary()'. This "
            f"bridge runs NCCL {bridge_nccl}; the trainer's must be the same version")


def wait_for_unique_id(store: Any, spec: JoinSpec, bridge_nccl: Callable[[], str], grace_s: float = UID_GRACE_S,
                       clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                       ) -> bytes:
    """The value under `broadcast_from/0/0` of the trainer's store, or a JoinError within the timeout: after
    `grace_s` from the moment all receiving ranks are in, it names why a trainer publishes none (vLLM's PyNccl
    disables itself silently, and the trainer's `trainer_init` then waits on the proxy's answer, not on NCCL)."""
    store.add(JOINED_KEY, 1)
    receivers = spec.world_size - 1
    deadline, all_in, joined = clock() + spec.timeout_s, None, 0
    while not store.check([UID_STORE_KEY]):
        now = clock()
        if all_in is None:
            joined = store.add(JOINED_KEY, 0)
            all_in = now if joined >= receivers else None
        if all_in is not None and now - all_in >= grace_s:
            raise JoinError(no_unique_id(spec, grace_s, bridge_nccl()))
        if now >= deadline:
            raise JoinError(f"rank {spec.rank}: the trainer's store at {spec.host}:{spec.port} gave no NCCL id "
                            f"within {spec.timeout_s:g} s ({joined} of {receivers} receiving rank(s) had joined it)")
        sleep(0.1)
    return store.get(UID_STORE_KEY)


def _version_or_unknown() -> str:
    try:
        return nccl_version()
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown (its libnccl did not load)"


def nccl_version() -> str:
    """The version of the NCCL this bridge joins with (the library `join` loads)."""
    return Nccl().version()


def trainer_env(given: dict[str, str], dialect: str) -> None:
    """The receiver's NCCL environment follows the trainer's, not SGLang's: SGLang's launcher exports
    NCCL_CUMEM_ENABLE=0 for its own processes, a stock vLLM 0.33 or prime-rl trainer runs NCCL's default (on),
    so an inherited value is dropped unless the operator gave it (--nccl-env). prime-rl's trainer and receiver
    both turn P2P/SHM off on a node without NVLink (prime-rl `utils/nccl.py`); the bridge applies the same rule
    for that dialect, so both sides agree."""
    os.environ.pop("NCCL_CUMEM_ENABLE", None)
    os.environ.update(given)
    if dialect == "primerl" and not _has_nvlink():
        os.environ.setdefault("NCCL_P2P_DISABLE", "1")
        os.environ.setdefault("NCCL_SHM_DISABLE", "1")


def _has_nvlink() -> bool:
    """prime-rl's test: any active NVLink on any GPU of the node (NVML), else a node of one GPU counts as fine."""
    try:
        import pynvml
    except ImportError:
        return True  # without NVML the rule cannot be applied; NCCL's defaults stand (as prime-rl's would fail)
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count < 2:
            return True
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for link in range(18):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                        return True
                except pynvml.NVMLError:
                    break
        return False
    finally:
        pynvml.nvmlShutdown()


def capture_nccl_warnings(directory: str) -> None:
    """Have NCCL write its warnings to a file, so a failed init can quote NCCL's own reason (for a version
    mismatch: both ranks' versions). Only when the user set neither; NCCL reads these at its first init."""
    if "NCCL_DEBUG_FILE" not in os.environ and "NCCL_DEBUG" not in os.environ:
        os.environ["NCCL_DEBUG"] = "WARN"
        os.environ["NCCL_DEBUG_FILE"] = os.path.join(directory, "nccl.%p.log")


def _nccl_reason(directory: str | None) -> str:
    if not directory:
        return ""
    for path in sorted(glob.glob(os.path.join(directory, f"nccl.{os.getpid()}.log"))):
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if "WARN" in line]
        mismatch = [line for line in lines if "Mismatched NCCL version" in line]
        if mismatch or lines:
            return (mismatch or lines)[-1].split("WARN", 1)[-1].strip()
    return ""


class Link:
    """One joined rank: the library, the communicator, its GPU and stream; a `wire.Channel` over torch tensors."""

    def __init__(self, nccl: Nccl, comm: Any, device: Any, stream: Any):
        self.nccl, self.comm, self.device, self.stream = nccl, comm, device, stream

    def recv(self, dtype: str, numel: int) -> Any:
        import torch

        with torch.cuda.stream(self.stream):
            buffer = torch.empty(numel, dtype=getattr(torch, dtype), device=self.device)
        code, count = wire_type(dtype, numel, itemsize(dtype))
        if count:
            self.nccl.broadcast(None, buffer.data_ptr(), count, code, 0, self.comm, self.stream.cuda_stream)
        return buffer

    def host_bytes(self, buffer: Any) -> bytes:
        import torch

        self.stream.synchronize()
        return bytes(buffer.view(-1).view(torch.uint8).cpu().tolist())

    def synchronize(self) -> None:
        self.stream.synchronize()


def load_nccl() -> Nccl:
    """torch's libnccl, loaded after torch's CUDA side is up (so `find_library` sees the copy torch mapped); a
    differing torch-reported version is named on stderr (the trainer's side runs torch's)."""
    import torch

    nccl = Nccl()
    try:
        torch_version = ".".join(str(p) for p in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - torch built without NCCL: nothing to compare
        torch_version = ""
    if torch_version and torch_version != nccl.version():
        logging.getLogger(__name__).warning(
            "NCCL %s loaded from %s (%s), but torch reports %s; set TOKEN_PROXY_NCCL_SO to torch's libnccl.so.2",
            nccl.version(), nccl.path, nccl.found_by, torch_version)
    return nccl


def join(spec: JoinSpec, nccl_log_dir: str | None = None) -> Link:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(spec.gpu)
    try:
        store = dist.TCPStore(spec.host, spec.port, world_size=spec.world_size, is_master=False,
                              timeout=timedelta(seconds=spec.timeout_s))
        uid = read_unique_id(wait_for_unique_id(store, spec, _version_or_unknown))
    except JoinError:
        raise
    except Exception as exc:
        raise JoinError(f"rank {spec.rank}: the trainer's store at {spec.host}:{spec.port} gave no NCCL id "
                        f"within {spec.timeout_s:g} s: {exc}") from exc
    try:
        nccl = load_nccl()
    except NcclError as exc:
        raise JoinError(f"rank {spec.rank}: {exc}") from exc
    device = torch.device("cuda", spec.gpu)
    stream = torch.cuda.Stream(device=device)
    comm = None
    try:
        with torch.cuda.device(device):
            comm = nccl.init_rank(spec.world_size, nccl.unique_id_from(uid.raw), spec.rank)
            with torch.cuda.stream(stream):  # vLLM's warm-up: one float32 zero, SUM, then a synchronize
                warm = torch.zeros(1, dtype=torch.float32, device=device)
            nccl.all_reduce(warm.data_ptr(), warm.data_ptr(), 1, wire_type("float32", 1, 4)[0], SUM, comm,
                            stream.cuda_stream)
            stream.synchronize()
    except Exception as exc:
        if comm is not None:
            try:
                nccl.abort(comm)
            except NcclError:
                pass
        reason = _nccl_reason(nccl_log_dir) or str(exc).splitlines()[0]
        raise JoinError(f"rank {spec.rank}: NCCL init with the trainer failed: {reason}. This bridge runs NCCL "
                        f"{nccl.version()} from {nccl.path} (torch {torch.__version__}); the trainer's must be the "
                        f"same version (install the trainer's torch or nvidia-nccl in the bridge's environment, or "
                        f"set TOKEN_PROXY_NCCL_SO)") from exc
    return Link(nccl, comm, device, stream)
