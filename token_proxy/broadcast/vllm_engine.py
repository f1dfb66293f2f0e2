"""A drop-in for vLLM 0.33's trainer-side NCCL weight-transfer engine, sending the way SGLang receives.

vLLM's sender (vllm/distributed/weight_transfer/nccl_engine.py, NCCLTrainerWeightTransferEngine) cannot
talk to SGLang: it forms its group with vLLM's PyNcclCommunicator over a StatelessProcessGroup (a TCPStore
holding a pickled ncclUniqueId, or a pre-minted id plus a one-element all_reduce handshake) and by default
packs tensors into fixed-size buffers. SGLang's /init_weights_update_group is a torch.distributed
rendezvous and /update_weights_from_distributed receives one broadcast per named tensor. This class keeps
vLLM's call shape and sends through SGLangBroadcaster instead; swap the import and nothing else:

    -from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine
    +from token_proxy.broadcast.vllm_engine import SGLangTrainerWeightTransferEngine as NCCLTrainerWeightTransferEngine

    engine = NCCLTrainerWeightTransferEngine.trainer_init(
        NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=1 + sglang_ranks, rank=rank),
        client=HTTPVLLMWeightSyncClient("http://proxy:8000"), source=source)
    engine.send_weights()                      # every rank; only rank 0 broadcasts
    client.finish_weight_update("step-12")     # optional: the version, verified on every worker
    engine.shutdown()

`init_info` may be vLLM's NCCLTrainerInitInfo or a dict with the same fields (`packed` and the buffer sizes
are accepted and ignored: SGLang receives unpacked); `client` is vLLM's HTTPVLLMWeightSyncClient (its
`base_url` is used) or a URL; `source` is a vLLM WeightSource (its iter_full() yields (name, tensor) in
metadata order) or any iterable of (name, tensor) pairs. With NCCL, `trainer_init` sets NCCL_CUMEM_ENABLE=0
(SGLang's setting) on every rank before NCCL starts, or raises BroadcastError naming it where that is too late.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from token_proxy.broadcast.broadcaster import SGLangBroadcaster
from token_proxy.broadcast.nccl_env import match_sglang


def _field(info, name: str, default=None):
    value = info.get(name, default) if isinstance(info, dict) else getattr(info, name, default)
    if value is None:
        raise ValueError(f"init_info needs {name}")
    return value


@dataclass
class SGLangTrainerWeightTransferEngine:
    broadcaster: SGLangBroadcaster | None  # None on non-sender ranks (rank != 0)
    source: object

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None, backend: str = "nccl",
                     timeout_s: float = 300.0) -> SGLangTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("weight transfer requires a WeightSource (or an iterable of (name, tensor) pairs)")
        rank = _field(init_info, "rank", 0)
        if backend == "nccl":  # every rank: the trainer's own communicators must agree with rank 0's
            match_sglang()
        if rank != 0:
            return cls(None, source)  # vLLM: only rank 0 opens the endpoint and drives the engine
        url = client if isinstance(client, str) else client.base_url
        broadcaster = SGLangBroadcaster(
            url=url, master_address=_field(init_info, "master_address"),
            master_port=_field(init_info, "master_port"),
            inference_world_size=_field(init_info, "world_size") - 1, backend=backend, timeout_s=timeout_s)
        broadcaster.init(announce=True)  # the proxy gives every worker its own rank_offset
        return cls(broadcaster, source)

    @property
    def is_sender(self) -> bool:
        return self.broadcaster is not None

    def send_weights(self, weight_version: str | None = None) -> int:
        """Every rank iterates the source (FSDP gathers are collectives); rank 0 broadcasts. Returns the
        number of buckets sent (0 on other ranks)."""
        pairs = self._pairs()
        if self.broadcaster is None:
            for _ in pairs:
                pass
            return 0
        return self.broadcaster.update(pairs, weight_version)

    def shutdown(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()

    def _pairs(self) -> Iterator:
        iter_full = getattr(self.source, "iter_full", None)
        source: Iterable = iter_full() if callable(iter_full) else self.source
        return iter(source)
