"""The bridge bench's CPU FALLBACK dry run (`bench/bench_bridge.py --cpu-fallback`): gloo instead of NCCL, shared
memory instead of CUDA IPC, the simulator (plus a stand-in /update_weights_from_tensor) instead of SGLang.

What it runs for real: the bench's own processes and code (both proxies, `python -m token_proxy.bridge`'s control
process and its spawned receivers with their TCPStore join, the id wait and the allowlisted id reader, the vLLM
decoders, the relay loop and the hand-off pickles; the trainer scripts; the report). What it replaces: the NCCL
communicator (a gloo group on the trainer's own store, bytes as uint8), CUDA IPC (the CPU tensors' storages by
shared-memory file name), and SGLang (the simulator, whose /update_weights_from_distributed receives over gloo).
So it proves the script, not the figures: its seconds say nothing about NCCL or SGLang's loads.

    python bench/bridge_cpu_fallback.py sglang PORT CHECKPOINT_DIR   # the stand-in SGLang (writes the checkpoint)
    python bench/bridge_cpu_fallback.py bridge ARGS...               # python -m token_proxy.bridge ARGS, on gloo
    python bench/bridge_cpu_fallback.py vllm-engine PROXY PORT CHECKPOINT_DIR VLLM_ENGINE_SRC PACKED_BYTES STEPS
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import os
import pickle
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from token_proxy.bridge import handoff, nccl
from token_proxy.bridge.unpickle import UID_STORE_KEY, read_unique_id

GLOO_PREFIX = "cpu-fallback-gloo"


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


class GlooCommunicator:
    """The trainer's rank 0 as vLLM's StatelessProcessGroup.create + PyNcclCommunicator open it (a TCPStore master
    of world W that waits for every rank, the id pickled as vLLM's ctypes struct under broadcast_from/0/0, a
    float32[1] SUM warm-up), with a gloo group on the same store where PyNccl calls ncclCommInitRank."""

    def __init__(self, port: int, world_size: int, timeout_s: float):
        from tests.bridge import upstream
        from tests.e2e.bridge_sender import _VllmUniqueId

        upstream.stub(_VllmUniqueId.__module__, ncclUniqueId=_VllmUniqueId)
        self.store = dist.TCPStore("127.0.0.1", port, world_size=world_size, is_master=True,
                                   timeout=timedelta(seconds=timeout_s), use_libuv=False)
        uid = _VllmUniqueId()
        ctypes.memmove(ctypes.addressof(uid), os.urandom(128), 128)
        self.store.set(UID_STORE_KEY, pickle.dumps(uid))
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(GLOO_PREFIX, self.store), 0, world_size,
                                           timedelta(seconds=timeout_s))
        self.group.allreduce([torch.zeros(1, dtype=torch.float32)]).wait()

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        assert src == 0
        self.group.broadcast([_bytes(tensor)], dist.BroadcastOptions()).wait()


class GlooLink:
    """nccl.Link's channel (recv, host_bytes, synchronize) over the gloo group: each buffer arrives as bytes."""

    def __init__(self, group):
        self.group = group

    def recv(self, dtype: str, numel: int) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=getattr(torch, dtype))
        if numel:
            self.group.broadcast([_bytes(buffer)], dist.BroadcastOptions()).wait()
        return buffer

    def host_bytes(self, buffer: torch.Tensor) -> bytes:
        return bytes(_bytes(buffer).tolist())

    def synchronize(self) -> None:
        pass


def gloo_join(spec: nccl.JoinSpec, nccl_log_dir: str | None = None) -> GlooLink:
    """nccl.join's store join, id wait and id read, as they are; then gloo where it runs ncclCommInitRank."""
    store = dist.TCPStore(spec.host, spec.port, world_size=spec.world_size, is_master=False,
                          timeout=timedelta(seconds=spec.timeout_s))
    read_unique_id(nccl.wait_for_unique_id(store, spec, lambda: "none (gloo fallback)"))
    group = dist.ProcessGroupGloo(dist.PrefixStore(GLOO_PREFIX, store), spec.rank, spec.world_size,
                                  timedelta(seconds=spec.timeout_s))
    group.allreduce([torch.zeros(1, dtype=torch.float32)]).wait()
    return GlooLink(group)


def patch_receivers() -> None:
    """In the bridge's processes (its spawned receivers import this file as __mp_main__): the transports above,
    and no-ops for the CUDA calls the receiver makes around them."""
    torch.multiprocessing.set_sharing_strategy("file_system")  # storages travel by shm name, as IPC handles do
    nccl.join = gloo_join
    nccl.nccl_version = lambda: "none (gloo fallback)"
    handoff.gpu_uuid = lambda gpu: f"CPU-fallback-{gpu}"
    torch.cuda.device = lambda _device: contextlib.nullcontext()
    torch.cuda.ipc_collect = lambda: None


if __name__ == "__mp_main__":
    patch_receivers()


class _NoStream:
    def synchronize(self) -> None:
        pass


def cpu_packing(packed_tensor) -> None:
    """vLLM's packed producer (packed_tensor.py, loaded unmodified) on CPU: its CUDA streams become no-ops, so its
    packing and chunk boundaries run as they are."""
    packed_tensor._get_streams = lambda _device, n: tuple(_NoStream() for _ in range(n))
    torch.accelerator.current_device_index = lambda: 0
    torch.cuda.stream = lambda _stream: contextlib.nullcontext()


def write_checkpoint(directory: Path) -> None:
    """The simulator's parameters (simulator/params.py: names, shapes, values) as a bf16 safetensors checkpoint:
    what the trainer pushes, the bridge checks names and shapes against, and the simulator loads."""
    from safetensors.torch import save_file

    from token_proxy.simulator import params

    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: torch.tensor(params.initial_values(shape, salt), dtype=torch.bfloat16)
               for salt, (name, shape) in enumerate(params.PARAM_SHAPES.items())},
              str(directory / "model.safetensors"))


async def update_weights_from_tensor(request):
    """SGLang's /update_weights_from_tensor, tp rank 0 only: the pickled [(name, tensor), ...] (here CPU tensors in
    shared memory) loaded into the simulator's parameters by name; an unknown name or shape is refused."""
    from aiohttp import web

    from token_proxy.simulator import params
    from token_proxy.simulator.weight_routes import WEIGHTS

    body = await request.json()
    named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
    values = request.app[WEIGHTS].values
    for name, tensor in named:
        if tuple(tensor.shape) != params.PARAM_SHAPES.get(name):
            return web.json_response({"success": False, "message": f"no parameter {name} of shape "
                                      f"{tuple(tensor.shape)}"}, status=400)
        values[name] = tensor.clone()  # the storage is the bridge's, freed after this answer
    return web.json_response({"success": True, "message": "Succeeded to update parameter online from tensor."})


def serve_sglang(port: int, checkpoint: Path) -> None:
    from aiohttp import web

    from token_proxy.simulator import SimConfig, create_sim_app
    from token_proxy.simulator.builtin_tokenizer import ensure_builtin_tokenizer

    write_checkpoint(checkpoint)
    tokenizer = ensure_builtin_tokenizer(checkpoint.parent / "tokenizer")
    app = create_sim_app(SimConfig(tokenizer_path=str(tokenizer), model_path=str(checkpoint)))
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def vllm_engine(proxy: str, port: int, checkpoint: Path, vllm_root: str, packed_bytes: int, steps: int) -> None:
    """vLLM 0.33's own trainer engine (NCCLTrainerWeightTransferEngine with its HTTPVLLMWeightSyncClient, loaded
    unmodified by tests/bridge/upstream.enter_vllm), pushing through the proxy and the bridge on CPU: only its
    endpoint (PyNcclCommunicator, which needs CUDA) is the GlooCommunicator above, and its CUDA streams no-ops.
    Step 1 sends the checkpoint + 1/8, step 2 the checkpoint; one JSON line per step."""
    import json

    from safetensors.torch import load_file

    from tests.bridge import upstream

    upstream.enter_vllm(vllm_root)
    from vllm.distributed.weight_transfer import nccl_engine, packed_tensor
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    nccl_engine.open_trainer_endpoint = lambda info: GlooCommunicator(info.master_port, info.world_size, 120)
    cpu_packing(packed_tensor)
    torch.cuda.current_stream = _NoStream

    base = load_file(str(checkpoint / "model.safetensors"))
    source = upstream.weight_source({k: v + 0.125 for k, v in base.items()})
    init = nccl_engine.NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2,
                                           packed=bool(packed_bytes), packed_buffer_size_bytes=packed_bytes or 1 << 30,
                                           packed_num_buffers=2, rank=0)
    engine = nccl_engine.NCCLTrainerWeightTransferEngine.trainer_init(
        init, client=HTTPVLLMWeightSyncClient(proxy, 120), source=source)
    print(json.dumps({"joined": True}), flush=True)
    for step in range(1, steps + 1):
        source.tensors = {k: v + 0.125 for k, v in base.items()} if step % 2 else dict(base)
        engine.send_weights()
        print(json.dumps({"step": step, "sent": {k: v.float().flatten()[:4].tolist()
                                                 for k, v in source.tensors.items()}}), flush=True)


def main() -> None:
    what, args = sys.argv[1], sys.argv[2:]
    if what == "sglang":
        serve_sglang(int(args[0]), Path(args[1]))
    elif what == "vllm-engine":
        vllm_engine(args[0], int(args[1]), Path(args[2]), args[3], int(args[4]), int(args[5]))
    elif what == "bridge":
        patch_receivers()
        from token_proxy.bridge.__main__ import main as bridge_main

        bridge_main(args)
    else:
        sys.exit(f"usage: {__doc__.splitlines()[-4].strip()} (or bridge, vllm-engine: see the docstring)")


if __name__ == "__main__":
    main()
