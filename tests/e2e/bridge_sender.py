"""A trainer for the bridge's GPU round (tests/e2e/test_live_bridge.py), on its own GPU: it opens the group as a vLLM
or prime-rl trainer does and pushes a checkpoint's tensors in either dialect.

    python tests/e2e/bridge_sender.py DIALECT PROXY_URL PORT MODEL_DIR STEPS_DIR [--packed-bytes N]

Dialect vllm-engine is vLLM 0.33's own trainer engine, unmodified (NCCLTrainerWeightTransferEngine with its
HTTPVLLMWeightSyncClient, its StatelessProcessGroup and PyNcclCommunicator), loaded from VLLM_ENGINE_SRC (the
wheel's .py files: .gpu/vllm033py.tar.xz, unpacked by gpu_round.sh); vllm_engine_trainer says what is ours. The
rest of this script is the fallback for when that source is absent. For primerl and vllm,
what is upstream's and what is a stand-in:
- the framing is upstream's own code when its source is given: PRIMERL_SRC (a directory holding prime_rl/ at
  @559b447; its transports/weights/nccl.py's broadcast_integer / broadcast_state_dict / filter_state_dict_by_layers)
  and VLLM_SRC (a directory holding vllm/distributed/weight_transfer/packed_tensor.py from vllm 0.33.0:
  packed_nccl_broadcast_producer). Both import only torch (their other imports are stubbed here);
- the group is opened by this script the way vLLM's StatelessProcessGroup.create + PyNcclCommunicator do
  (TCPStore master of world W with use_libuv=False, the id pickled as vLLM's ctypes ncclUniqueId under
  broadcast_from/0/0, ncclCommInitRank, a float32[1] SUM all-reduce warm-up), over the bridge's ctypes binding of
  torch's libnccl (token_proxy/bridge/libnccl.py, the same kind of binding as vLLM's PyNccl, with its argument
  types) instead of vLLM's own: vLLM 0.33 (a 336 MB wheel, torch 2.14) cannot be carried to the GPU host, and
  torch.cuda.nccl.init_rank raises SystemError (PY_SSIZE_T_CLEAN) on Python >= 3.10. The collectives are PyNccl's
  calls (ncclBroadcast root 0 on the current stream, ncclAllReduce), so the bridge cannot tell the difference; what
  this does not cover is PyNccl's own code and vLLM 0.33's torch/NCCL 2.30.7.
- the HTTP calls are the trainers' own sequence: prime-rl's orchestrator (/init_broadcaster once; per step /pause,
  NCCL_READY, /update_weights {"weight_dir"}, /resume) and vLLM's engine (/init_weight_transfer_engine during the
  rendezvous; per push /start_weight_update, /update_weights concurrently with the broadcast,
  /finish_weight_update).

Each push sends the checkpoint perturbed (step 1, seeded) then restored (step 2), and prints one JSON line per push.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pickle
import sys
import threading
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.bridge import upstream
from token_proxy.bridge.libnccl import NCCL_DTYPES, SUM, Nccl, wire_type


class _VllmUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


_VllmUniqueId.__module__ = "vllm.distributed.device_communicators.pynccl_wrapper"
_VllmUniqueId.__qualname__ = _VllmUniqueId.__name__ = "ncclUniqueId"


class Communicator:
    """Rank 0 of the trainer's group, as PyNcclCommunicator opens it (over the same ctypes calls)."""

    def __init__(self, port: int, world_size: int, timeout_s: float):
        upstream.stub(_VllmUniqueId.__module__, ncclUniqueId=_VllmUniqueId)  # pickle finds it by vLLM's name
        self.nccl = Nccl()
        print(json.dumps({"nccl": self.nccl.version(), "nccl_so": self.nccl.path, "found_by": self.nccl.found_by,
                          "torch_nccl": ".".join(map(str, torch.cuda.nccl.version()))}), file=sys.stderr, flush=True)
        self.store = dist.TCPStore("127.0.0.1", port, world_size=world_size, is_master=True,
                                   timeout=timedelta(seconds=timeout_s), use_libuv=False)  # waits for W
        uid = self.nccl.unique_id()
        struct = _VllmUniqueId()
        ctypes.memmove(ctypes.addressof(struct), ctypes.addressof(uid), 128)
        self.store.set("broadcast_from/0/0", pickle.dumps(struct))
        self.device = torch.device("cuda", 0)
        with torch.cuda.device(self.device):
            self.comm = self.nccl.init_rank(world_size, uid, 0)
            stream = torch.cuda.current_stream()
            warm = torch.zeros(1, device=self.device)
            self.nccl.all_reduce(warm.data_ptr(), warm.data_ptr(), 1, NCCL_DTYPES["float32"], SUM, self.comm,
                                 stream.cuda_stream)
            stream.synchronize()

    def broadcast(self, tensor, src=0, stream=None):
        """PyNcclCommunicator.broadcast from the root: the tensor is both buffers, on the caller's current stream."""
        assert src == 0
        tensor = tensor.contiguous()  # a copy on the current stream when not (freed after the send, same stream)
        stream = torch.cuda.current_stream() if stream is None else stream
        code, count = wire_type(str(tensor.dtype).split(".")[-1], tensor.numel(), tensor.element_size())
        self.nccl.broadcast(tensor.data_ptr(), tensor.data_ptr(), count, code, 0, self.comm, stream.cuda_stream)


def primerl_framing():
    root = os.environ.get("PRIMERL_SRC")
    if not root:
        return None
    upstream.stub_primerl_imports()
    return upstream.load("prime_rl.transports.weights.nccl", Path(root) / "prime_rl/transports/weights/nccl.py")


def vllm_framing():
    root = os.environ.get("VLLM_SRC")
    if not root:
        return None
    return upstream.load("vllm_packed_tensor", Path(root) / "vllm/distributed/weight_transfer/packed_tensor.py")


def post(url: str, path: str, body: dict | None = None, timeout: float = 720) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def checkpoint(model_dir: str, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f), device="cuda"))
    if step % 2 == 1:  # odd steps perturbed, even steps the checkpoint's own values
        g = torch.Generator(device="cuda").manual_seed(step)
        tensors = {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g, device="cuda")).to(v.dtype)
                   for k, v in tensors.items()}
    return tensors


BAD_TENSOR = "model.layers.0.mlp.down_proj.weight"  # in prime-rl's layer-0 chunk (the second of the stream)


def spoil(tensors: dict, how: str) -> dict:
    """A trainer's bad step (the refused-name drill): one tensor under a name SGLang has no parameter for, or
    flattened to a shape SGLang's parameter does not have."""
    tensors = dict(tensors)
    bad = tensors.pop(BAD_TENSOR)
    if how == "name":
        tensors[BAD_TENSOR.replace("down_proj", "down_prj")] = bad
    else:
        tensors[BAD_TENSOR] = bad.reshape(-1)
    return tensors


def primerl_push(comm: Communicator, tensors: dict, framing, pause_s: float = 0.0) -> None:
    prefix = "model.layers."
    layers = 1 + max(int(k[len(prefix):].split(".")[0]) for k in tensors if k.startswith(prefix))
    if framing is None:
        raise SystemExit("PRIMERL_SRC is not set: the prime-rl round needs prime-rl's own framing code")
    framing.broadcast_integer(layers + 1, comm)
    for _layer, part in framing.filter_state_dict_by_layers(tensors, layers, prefix):
        framing.broadcast_state_dict(part, comm)
        if pause_s:  # the kill drill: a slow trainer, so that the bridge dies between two chunks of one push
            torch.cuda.synchronize()
            print(json.dumps({"chunk_sent": sorted(part)[:1]}), flush=True)
            time.sleep(pause_s)
    torch.cuda.synchronize()


def vllm_push(url: str, comm: Communicator, tensors: dict, packed_bytes: int, version: str, framing) -> None:
    info = {"names": list(tensors), "dtype_names": [str(t.dtype).split(".")[-1] for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()]}
    post(url, "/start_weight_update")
    errors = []
    rpc = threading.Thread(target=lambda: _capture(errors, post, url, "/update_weights", {"update_info": info}))
    rpc.start()
    if packed_bytes:
        if framing is None:
            raise SystemExit("VLLM_SRC is not set: the packed round needs vLLM's own packing code")
        framing.packed_nccl_broadcast_producer(iter(tensors.items()), comm, 0, lambda item: item[1],
                                               buffer_size_bytes=packed_bytes, num_buffers=2)
    else:
        for t in tensors.values():
            comm.broadcast(t, src=0)
    torch.cuda.synchronize()
    rpc.join()
    if errors:
        raise errors[0]
    post(url, "/finish_weight_update", {"weight_version": version})


def vllm_engine_trainer(args) -> None:
    """vLLM 0.33's own trainer engine, unmodified (VLLM_ENGINE_SRC: the wheel's .py files, .gpu/vllm033py):
    NCCLTrainerWeightTransferEngine.trainer_init with vLLM's HTTP client pointed at the proxy, then send_weights()
    per step; the only code of ours is the WeightSource (the trainer's weights: a checkpoint's tensors, perturbed
    on odd steps), which vLLM leaves to the trainer, and tests/bridge/upstream.py's entry into vLLM's files."""
    upstream.enter_vllm(os.environ["VLLM_ENGINE_SRC"])

    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    # PyNcclCommunicator turns itself off without a word when NCCLLibrary() raises, and then publishes no NCCL id:
    # the receiver waits (seen on the GPU host: 300 s; the bridge now names it after 30 s). vLLM 0.33 binds
    # ncclCommSuspend and ncclCommResume, which NCCL exports from 2.29.7 on; torch 2.11's NCCL is 2.28.9. Those two
    # serve sleep mode only (upstream.SLEEP_MODE_ONLY says where), so the round drops them from vLLM's binding
    # when this host's NCCL lacks them (printed below); any other failure is said at once instead.
    nccl_version = ".".join(map(str, torch.cuda.nccl.version()))
    if args.keep_vllm_nccl:  # the drill: vLLM's binding as it is, so that PyNccl may turn itself off
        try:
            NCCLLibrary()
            print(json.dumps({"pynccl_loads": nccl_version}), flush=True)
            return
        except Exception as exc:  # noqa: BLE001 - what vLLM swallows, said here for the log
            print(json.dumps({"pynccl_off": f"NCCL {nccl_version}: {exc!r}"}), flush=True)
        dropped = []
    else:
        dropped = upstream.fit_vllm_nccl()
        print(json.dumps({"vllm_nccl_dropped": dropped, "nccl": nccl_version}), file=sys.stderr, flush=True)
        try:
            NCCLLibrary()
        except Exception as exc:  # noqa: BLE001 - reported, then this trainer stops
            print(json.dumps({"engine_unusable": f"vLLM 0.33's PyNcclCommunicator cannot load this process's NCCL "
                              f"({nccl_version}) and would disable itself silently: {exc!r}"}), flush=True)
            sys.exit(3)

    source = upstream.weight_source(checkpoint(args.model_dir, 1))
    init = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=args.port, world_size=2,
                               packed=bool(args.packed_bytes), packed_buffer_size_bytes=args.packed_bytes or (1 << 30),
                               packed_num_buffers=2, rank=0)
    t0 = time.perf_counter()
    engine = NCCLTrainerWeightTransferEngine.trainer_init(init, client=HTTPVLLMWeightSyncClient(args.proxy, 720),
                                                          source=source)
    print(json.dumps({"joined_s": round(time.perf_counter() - t0, 3), "engine": "vllm==0.33.0",
                      "nccl": getattr(engine.model_update_group, "nccl_version", None),
                      "vllm_nccl_dropped": dropped}), flush=True)
    for step in range(1, args.steps + 1):
        source.tensors = checkpoint(args.model_dir, step)  # same names and shapes: vLLM sends the metadata once
        if args.gated:
            wait_ready(args.steps_dir, step)
        t0 = time.perf_counter()
        engine.send_weights()
        print(json.dumps({"step": step, "pushed_s": round(time.perf_counter() - t0, 3),
                          "bytes": sum(t.numel() * t.element_size() for t in source.tensors.values())}), flush=True)


def wait_ready(steps_dir: str, step: int) -> None:
    """prime-rl's trainer waits for the orchestrator's NCCL_READY in the step's directory; with --gated the vLLM
    trainers do too (the test's cue, so that each push runs under its rollouts and is checked before the next)."""
    ready = Path(steps_dir) / f"step_{step}" / "NCCL_READY"
    while not ready.exists():
        time.sleep(0.05)


def _capture(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - surfaced by the caller
        errors.append(exc)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dialect", choices=["primerl", "vllm", "vllm-engine"])
    p.add_argument("proxy")
    p.add_argument("port", type=int)
    p.add_argument("model_dir")
    p.add_argument("steps_dir")
    p.add_argument("--packed-bytes", type=int, default=0, help="vLLM packed with this buffer; 0: unpacked")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--bad-step", type=int, default=0, help="this step sends one tensor spoiled as --bad says")
    p.add_argument("--bad", choices=["name", "shape"], default="name")
    p.add_argument("--pause-between-s", type=float, default=0.0, help="prime-rl: sleep after each chunk")
    p.add_argument("--gated", action="store_true", help="vLLM: each push waits for STEPS_DIR/step_N/NCCL_READY")
    p.add_argument("--keep-vllm-nccl", action="store_true",
                   help="vllm-engine: vLLM's NCCL binding as it is (no upstream.fit_vllm_nccl): the PyNccl-off drill")
    args = p.parse_args()
    torch.cuda.set_device(0)
    if args.dialect == "vllm-engine":
        vllm_engine_trainer(args)
        return
    init_errors: list = []
    if args.dialect == "primerl":  # the orchestrator's init, while the trainer opens its group
        body = {"host": "127.0.0.1", "port": args.port, "rank_offset": 0, "inference_world_size": 1, "timeout": 300}
        call = threading.Thread(target=lambda: _capture(init_errors, post, args.proxy, "/init_broadcaster", body))
    else:
        body = {"init_info": {"master_address": "127.0.0.1", "master_port": args.port, "rank_offset": 1,
                              "world_size": 2, "packed": bool(args.packed_bytes),
                              "packed_buffer_size_bytes": args.packed_bytes or (1 << 30), "packed_num_buffers": 2}}
        call = threading.Thread(target=lambda: _capture(init_errors, post, args.proxy, "/init_weight_transfer_engine", body))
    call.start()
    t0 = time.perf_counter()
    comm = Communicator(args.port, 2, 300)
    call.join()
    if init_errors:
        raise init_errors[0]
    print(json.dumps({"joined_s": round(time.perf_counter() - t0, 3)}), flush=True)
    framing = primerl_framing() if args.dialect == "primerl" else vllm_framing()
    for step in range(1, args.steps + 1):
        tensors = checkpoint(args.model_dir, step)
        if step == args.bad_step:
            tensors = spoil(tensors, args.bad)
        if args.dialect == "primerl" or args.gated:  # prime-rl: the orchestrator paused and touched NCCL_READY
            wait_ready(args.steps_dir, step)
        t0 = time.perf_counter()
        if args.dialect == "primerl":
            primerl_push(comm, tensors, framing, args.pause_between_s)
        else:
            vllm_push(args.proxy, comm, tensors, args.packed_bytes, f"v{step}", framing)
        print(json.dumps({"step": step, "pushed_s": round(time.perf_counter() - t0, 3),
                          "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}), flush=True)


if __name__ == "__main__":
    main()
