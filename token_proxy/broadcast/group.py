"""SGLang's weight-update group, joined the way SGLang joins it (utils.init_custom_process_group):
a tcp:// rendezvous whose store is prefixed by the group name, and a process group kept out of
torch's default world. Both sides must build it identically, so the simulator uses this too."""

from __future__ import annotations

from datetime import timedelta


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float, op_timeout_s: float | None = None):
    """Blocks until all `world_size` ranks joined (or `timeout_s` passed: torch's DistStoreError).
    Rank 0 (the trainer) hosts the rendezvous store at master_address:master_port. The group's
    collectives time out after `op_timeout_s` (default `timeout_s`)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None,
                                         timeout=timeout if op_timeout_s is None else timedelta(seconds=op_timeout_s))
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_group(group) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)


def abort_group(group, wait_s: float) -> bool:
    """Abort a group whose collective may never finish, and free its name for the next join: torch's
    `_abort_process_group` (NCCL: ncclCommAbort, which ends its kernels; gloo: pending work ends at the
    group's own timeout, in gloo's threads). Runs in a daemon thread waited for at most `wait_s`, since an
    abort may block too; False if it had not returned by then."""
    import threading

    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", distributed_c10d.destroy_process_group)
    done = threading.Event()

    def run() -> None:
        try:
            abort(group)
        except (RuntimeError, ValueError):  # already aborted or destroyed: nothing left to free
            pass
        finally:
            done.set()

    threading.Thread(target=run, name="broadcaster-abort", daemon=True).start()
    return done.wait(wait_s)
