"""One receiving rank: a process bound to one GPU that joins the trainer's group and turns each push into buckets
for SGLang (torch, in this process only).

The bridge's control process talks to it over a pipe:
- → ("push", PushSpec) / ("stop",); ← ("joined", facts) or ("failed", line) once at start;
- per push ← ("bucket", index, {tp_rank: payload}, nbytes, tensors, [(name, shape), ...]) and → ("ack", index, ok, message) for each,
  then ← ("done", totals) or ("failed", line).

Double-buffered: bucket k is sent for loading, then bucket k+1 is received from NCCL while SGLang loads k; k's
buffers are released only after its ack (SGLang has answered), so at most two buckets are alive. After a refused
bucket the rank keeps receiving to the end of the stream (the trainer's collectives must complete) and hands
nothing more on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from token_proxy.bridge.layout import Receiver
from token_proxy.bridge.wire import Bucket, TensorMeta, primerl_push, vllm_push


@dataclass(frozen=True)  # pickled to the receiver processes (slots break that on 3.10)
class PushSpec:
    dialect: str  # "primerl" or "vllm"
    metas: tuple[TensorMeta, ...] = ()
    packed: bool = True
    buffer_size_bytes: int = 1 << 30


@dataclass
class PushTotals:
    buckets: int = 0
    tensors: int = 0
    nbytes: int = 0
    refused: str = ""
    drained: int = field(default=0)  # buckets received after a refusal and dropped


def shapes_of(bucket: Bucket[Any]) -> list[tuple[str, tuple[int, ...]]]:
    """What the control process checks before SGLang loads the bucket (params.refusal)."""
    return [(slot.name, slot.shape) for slot in bucket.slots]


def buckets_of(spec: PushSpec, channel: Any) -> Iterator[Bucket[Any]]:
    if spec.dialect == "primerl":
        return primerl_push(channel)
    return vllm_push(channel, spec.metas, packed=spec.packed, buffer_size_bytes=spec.buffer_size_bytes)


def relay(buckets: Iterator[Bucket[Any]], *, settle: Callable[[], None],
          hand_on: Callable[[int, Bucket[Any]], None], await_ack: Callable[[int], tuple[bool, str]],
          release: Callable[[], None] = lambda: None) -> PushTotals:
    """The push loop, without torch: `settle` waits for the bucket's receives to land, `hand_on` sends it for
    loading, `await_ack` waits for SGLang's answer on an earlier bucket, `release` frees what was dropped."""
    totals = PushTotals()
    pending: tuple[int, Bucket[Any]] | None = None
    for index, bucket in enumerate(buckets):
        settle()
        totals.buckets += 1
        if pending is not None:
            _finish(pending[0], await_ack, totals)
            pending = None
            release()
        if totals.refused:
            totals.drained += 1
            del bucket
            release()
            continue
        hand_on(index, bucket)
        totals.tensors += len(bucket.slots)
        totals.nbytes += bucket.nbytes
        pending = (index, bucket)
    if pending is not None:
        _finish(pending[0], await_ack, totals)
        release()
    return totals


def _finish(index: int, await_ack: Callable[[int], tuple[bool, str]], totals: PushTotals) -> None:
    ok, message = await_ack(index)
    if not ok and not totals.refused:
        totals.refused = message


def serve(conn: Any, plan: Receiver, join_spec: Any, env: dict[str, str], log_dir: str, dialect: str) -> None:
    """The receiver process's main: join, then run pushes until told to stop."""
    from token_proxy.bridge import handoff, nccl

    nccl.trainer_env(env, dialect)

    nccl.capture_nccl_warnings(log_dir)
    try:
        link = nccl.join(join_spec, log_dir)
    except nccl.JoinError as exc:
        conn.send(("failed", str(exc)))
        return
    uuid = handoff.gpu_uuid(plan.gpu)
    conn.send(("joined", {"rank": plan.rank, "gpu": plan.gpu, "uuid": uuid, "nccl": nccl.nccl_version()}))
    while True:
        message = conn.recv()
        if message[0] != "push":
            return
        try:
            totals = _push(conn, link, plan, uuid, message[1])
        except Exception as exc:  # noqa: BLE001 - a torn stream leaves the group unusable: report and exit
            conn.send(("failed", f"rank {plan.rank}: {type(exc).__name__}: {exc}"))
            return
        conn.send(("done", totals))


def _push(conn: Any, link: Any, plan: Receiver, uuid: str, spec: PushSpec) -> PushTotals:
    import torch

    from token_proxy.bridge import handoff

    def hand_on(index: int, bucket: Bucket[Any]) -> None:
        named = handoff.named_views(bucket)
        payloads = {g.tp_rank: handoff.ipc_payload(named, uuid) for g in plan.serves}
        conn.send(("bucket", index, payloads, bucket.nbytes, len(bucket.slots), shapes_of(bucket)))

    def await_ack(index: int) -> tuple[bool, str]:
        kind, acked, ok, text = conn.recv()
        if (kind, acked) != ("ack", index):
            raise RuntimeError(f"expected the ack of bucket {index}, got {kind} {acked}")
        return ok, text

    with torch.cuda.device(plan.gpu):
        return relay(buckets_of(spec, link), settle=link.synchronize, hand_on=hand_on, await_ack=await_ack,
                     release=torch.cuda.ipc_collect)
