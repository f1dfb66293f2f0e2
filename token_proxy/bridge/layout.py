"""Which receiving rank serves which SGLang GPU (pure).

The trainer fixes its group's size (prime-rl: `inference_world_size + 1`; vLLM: `world_size`, with the workers from
`rank_offset` 1). A bridge is given a contiguous slice of that group, `ranks` ranks from `rank_offset`, and the
SGLang GPUs it serves, in worker order then TP rank. It takes:
- one rank per GPU when the slice is as large as its GPU count (each rank receives on the GPU its TP rank
  loads from, so SGLang's `.to(device)` is a no-op);
- one rank per worker when the slice equals its worker count (that rank's buffer is handed to every TP rank of
  the worker; the other TP ranks copy it across GPUs);
- anything else is refused with the sizes that would fit. Two ranks on one GPU are refused too: NCCL's
  "Duplicate GPU detected".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class LayoutError(ValueError):
    """The trainer's group cannot be mapped onto the SGLang GPUs this bridge serves."""


@dataclass(frozen=True)  # pickled to the receiver processes (slots break that on 3.10)
class Gpu:
    """One SGLang TP rank: its worker's URL, its TP rank, the physical GPU it runs on (and that GPU's UUID)."""

    worker: str
    tp_rank: int
    gpu: int
    uuid: str = ""


@dataclass(frozen=True)  # pickled to the receiver processes (slots break that on 3.10)
class Receiver:
    """One receiving rank: its rank in the trainer's group, the GPU it receives on, the TP ranks it feeds."""

    rank: int
    gpu: int
    serves: tuple[Gpu, ...]


def plan_receivers(gpus: Sequence[Gpu], *, world_size: int, rank_offset: int, ranks: int) -> list[Receiver]:
    _check_slice(world_size, rank_offset, ranks)
    if not gpus:
        raise LayoutError("this bridge serves no SGLang GPU")
    seen: dict[int, Gpu] = {}
    for g in gpus:
        if g.gpu in seen:
            raise LayoutError(f"GPU {g.gpu} is used by {seen[g.gpu].worker} and {g.worker}: one receiving rank "
                              f"per GPU (NCCL refuses two ranks of one group on one GPU)")
        seen[g.gpu] = g
    workers = _by_worker(gpus)
    if ranks == len(gpus):
        return [Receiver(rank_offset + i, g.gpu, (g,)) for i, g in enumerate(gpus)]
    if ranks == len(workers):
        return [Receiver(rank_offset + i, tps[0].gpu, tuple(tps)) for i, tps in enumerate(workers)]
    raise LayoutError(f"the trainer's group gives this bridge {ranks} rank(s), but it serves {len(gpus)} SGLang "
                      f"GPU(s) on {len(workers)} worker(s): size the trainer's inference world to {len(gpus)} "
                      f"(one rank per GPU) or {len(workers)} (one per worker)")


def _check_slice(world_size: int, rank_offset: int, ranks: int) -> None:
    if rank_offset < 1:
        raise LayoutError(f"rank_offset {rank_offset}: rank 0 is the trainer's sender; receivers start at 1")
    if ranks < 1 or rank_offset + ranks > world_size:
        raise LayoutError(f"ranks {rank_offset}..{rank_offset + ranks - 1} do not fit a group of {world_size}")


def _by_worker(gpus: Sequence[Gpu]) -> list[list[Gpu]]:
    order: dict[str, list[Gpu]] = {}
    for g in gpus:
        order.setdefault(g.worker, []).append(g)
    for tps in order.values():
        tps.sort(key=lambda g: g.tp_rank)
    return list(order.values())
