"""Joining the trainer's NCCL group exactly as vLLM's receiver does (torch imported lazily, in the receiver process).

vLLM's and prime-rl's receivers (`StatelessProcessGroup.create` + `PyNcclCommunicator`, vLLM 0.33
`distributed/utils.py` and `device_communicators/pynccl.py`; the same in 0.26, prime-rl's pin) do, in order:
1. a TCPStore client of the trainer's store, counted in its world (`world_size=W`, the default wait_for_workers);
2. the unique id from `broadcast_from/0/0` (unpickled here through the allowlist, either encoding);
3. `ncclCommInitRank(W, uid, rank)`;
4. a warm-up all-reduce of one float32 zero (SUM), then a stream synchronize. The trainer's constructor blocks
   in its own warm-up until every rank has joined it.

The binding is torch's own, `torch.cuda.nccl` (`init_rank`, `broadcast`, `all_reduce`): it is the NCCL torch links,
which is the library vLLM's PyNccl loads too (vLLM's `find_nccl_library` resolves torch's nvidia-nccl), it takes the
raw 128-byte id, and its broadcast is `ncclBcast` with root 0, the trainer's rank. Hand-written ctypes would
duplicate what torch maintains; cupy's bindings would load a second libnccl next to torch's in one process (symbol
interposition) and are a large wheel the GPU hosts do not carry. So the bridge's NCCL is its torch's: pin the
trainer's torch (or nvidia-nccl-cuXX) in the bridge's environment.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from token_proxy.bridge.unpickle import UID_STORE_KEY, read_unique_id


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


def nccl_version() -> str:
    import torch

    return ".".join(str(p) for p in torch.cuda.nccl.version())


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
    """One joined rank: the communicator, its GPU and stream; a `wire.Channel` over torch tensors."""

    def __init__(self, comm: Any, device: Any, stream: Any):
        self.comm, self.device, self.stream = comm, device, stream

    def recv(self, dtype: str, numel: int) -> Any:
        import torch

        with torch.cuda.stream(self.stream):
            buffer = torch.empty(numel, dtype=getattr(torch, dtype), device=self.device)
            torch.cuda.nccl.broadcast([buffer], root=0, streams=[self.stream], comms=[self.comm])
        return buffer

    def host_bytes(self, buffer: Any) -> bytes:
        import torch

        self.stream.synchronize()
        return bytes(buffer.view(-1).view(torch.uint8).cpu().tolist())

    def synchronize(self) -> None:
        self.stream.synchronize()


def join(spec: JoinSpec, nccl_log_dir: str | None = None) -> Link:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(spec.gpu)
    try:
        store = dist.TCPStore(spec.host, spec.port, world_size=spec.world_size, is_master=False,
                              timeout=timedelta(seconds=spec.timeout_s))
        uid = read_unique_id(store.get(UID_STORE_KEY))
    except Exception as exc:
        raise JoinError(f"rank {spec.rank}: the trainer's store at {spec.host}:{spec.port} gave no NCCL id "
                        f"within {spec.timeout_s:g} s: {exc}") from exc
    device = torch.device("cuda", spec.gpu)
    stream = torch.cuda.Stream(device=device)
    try:
        comm = torch.cuda.nccl.init_rank(spec.world_size, uid.raw, spec.rank)
        link = Link(comm, device, stream)
        warm = torch.zeros(1, dtype=torch.float32, device=device)
        torch.cuda.nccl.all_reduce([warm], streams=[stream], comms=[comm])
        stream.synchronize()
    except Exception as exc:
        reason = _nccl_reason(nccl_log_dir) or str(exc).splitlines()[0]
        raise JoinError(f"rank {spec.rank}: NCCL init with the trainer failed: {reason}. This bridge runs NCCL "
                        f"{nccl_version()} (torch {torch.__version__}); the trainer's must be the same version "
                        f"(install the trainer's torch or nvidia-nccl in the bridge's environment)") from exc
    return link
