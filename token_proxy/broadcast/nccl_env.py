"""NCCL settings the trainer must share with SGLang, set before this process's NCCL reads them.

SGLang sets NCCL_CUMEM_ENABLE=0 unless told otherwise (entrypoints/engine.py `_set_envs_and_config`, 0.5.17 to
0.5.23: `str(int(server_args.enable_symm_mem))`). NCCL >= 2.19 defaults it to 1 (cuMem P2P buffers), and a
communicator whose ranks disagree fails in SGLang's transport/p2p.cc ("Cuda failure 'invalid argument'").
NCCL reads the variable once per process, when its first communicator starts, so it must be set before then:
once torch.distributed runs NCCL here, setting it is too late, and that is an error naming the fix.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, MutableMapping

from token_proxy.broadcast.errors import BroadcastError

SETTING, SGLANG_VALUE = "NCCL_CUMEM_ENABLE", "0"
FIX = (f"start the trainer with {SETTING}={SGLANG_VALUE} in its environment (as SGLang runs), "
       "e.g. `NCCL_CUMEM_ENABLE=0 torchrun ...`")


def nccl_groups() -> list[str]:
    """The torch.distributed process groups of this process that use NCCL: the default one and any other
    (their communicators may have started, and with them NCCL's one reading of the environment). None
    where torch.distributed was never imported."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return []
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    return ["default" if group is distributed_c10d.GroupMember.WORLD else world.pg_names.get(group, "?")
            for group, (backend, _) in list(world.pg_map.items())
            if "nccl" in f"{backend} {world.pg_backend_config.get(group, '')}".lower()]


def match_sglang(environ: MutableMapping[str, str] = os.environ,
                 started: Callable[[], list[str]] | None = None) -> None:
    """Set NCCL_CUMEM_ENABLE=0 for this process's NCCL, or raise BroadcastError (one line) where it is too
    late or the user chose otherwise. Call it before any NCCL group is created, on every trainer rank
    (ranks of one communicator must agree too)."""
    value = environ.get(SETTING)
    if value == SGLANG_VALUE:
        return
    if value is not None:
        raise BroadcastError(f"{SETTING}={value} is set, but SGLang runs with {SETTING}={SGLANG_VALUE} and NCCL "
                             f"cannot connect the two (transport/p2p.cc): unset it or set {SETTING}={SGLANG_VALUE}")
    groups = (started or nccl_groups)()
    if groups:
        raise BroadcastError(f"NCCL is already in use in this process (torch.distributed group(s) "
                             f"{', '.join(groups)} on nccl) without {SETTING}={SGLANG_VALUE}, which SGLang needs "
                             f"and NCCL reads only once: {FIX}")
    environ[SETTING] = SGLANG_VALUE
