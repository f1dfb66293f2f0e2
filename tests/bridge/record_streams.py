"""Re-record tests/bridge/fixtures/ from the REAL upstream senders, on CPU (a throwaway venv, not the project's).

The senders run unmodified; only their communicator is a stand-in that captures each broadcast's dtype, size and
bytes (what rank 0 would put on the wire), and CUDA-only calls (.cuda(), streams, events) are made no-ops on CPU.
No upstream code is copied into the project: the modules are loaded from the unpacked wheel / checkout given on
the command line.

    python3 -m venv /tmp/recvenv && /tmp/recvenv/bin/pip install torch==2.13.0 numpy
    pip download --no-deps vllm==0.33.0 -d /tmp/vllm033 && (cd /tmp/vllm033 && unzip -q vllm-*.whl 'vllm/*' -d x)
    git -C <prime-rl> show 559b44772e471d1538537b8805cc77f3824a5e64:src/prime_rl/transports/weights/nccl.py > ...
      (and trainer/conversion_utils.py; see --prime-rl)
    /tmp/recvenv/bin/python tests/bridge/record_streams.py --vllm /tmp/vllm033/x --prime-rl /tmp/primerl \
        --out tests/bridge/fixtures

Recorded:
- vllm_packed: vLLM 0.33's NCCLTrainerWeightTransferEngine.send_weights (packed, 1 KiB buffers), its
  /update_weights metadata, and the chunk sizes vLLM's own packed_nccl_broadcast_consumer posts for that metadata
  (replayed against the recording);
- vllm_unpacked: the same engine with packed=False;
- primerl: prime-rl@559b447's broadcast_integer / broadcast_state_dict over filter_state_dict_by_layers, in the
  order NCCLWeightBroadcastSender.broadcast_weights calls them (the HF-name conversion step is skipped: the tiny
  model already has HF names), and the broadcasts prime-rl's own receiver (inference/vllm/worker/nccl.py)
  posts when replayed; the expected tensors are what that receiver yields;
- uid_vllm_ctypes.pkl: pickle.dumps of vLLM's ncclUniqueId (what StatelessProcessGroup.broadcast_obj stores);
  uid_raw_bytes.pkl: pickle.dumps of the 128 raw bytes (ART's encoding).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pickle
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository's tests package
from tests.bridge.upstream import load, stub, stub_primerl_imports


class _Stream:
    def synchronize(self):
        pass

    def wait_event(self, _event):
        pass


class _Event:
    def record(self, _stream=None):
        pass


def cpu_only_cuda() -> None:
    """The CUDA calls the senders make, as no-ops on CPU (the bytes they move are untouched)."""
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.record_stream = lambda self, stream: None
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a: _Stream()
    torch.accelerator.current_stream = lambda *a: _Stream()
    torch.accelerator.current_device_index = lambda: 0
    torch.Event = _Event


class Recorder:
    """Rank 0's communicator: each broadcast's dtype, numel and bytes, in order."""

    def __init__(self):
        self.sent: list[tuple[str, int, bytes]] = []

    def broadcast(self, tensor, src=0, stream=None):
        assert src == 0
        t = tensor.contiguous()
        self.sent.append((str(t.dtype).removeprefix("torch."), t.numel(), t.view(-1).view(torch.uint8).numpy().tobytes()))


class Replayer:
    """A receiver's communicator: fills each posted buffer from the recording, and notes what was posted."""

    def __init__(self, sent):
        self.sent, self.posted, self.device = list(sent), [], "cpu"

    def broadcast(self, tensor, src=0, stream=None):
        dtype, numel, raw = self.sent.pop(0)
        self.posted.append((str(tensor.dtype).removeprefix("torch."), tensor.numel()))
        assert (self.posted[-1][0], self.posted[-1][1]) == (dtype, numel), (self.posted[-1], dtype, numel)
        tensor.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def tiny_model() -> torch.nn.Module:
    """HF-named, two layers, two dtypes (bf16 weights, fp32 norms), sizes that cross 1 KiB chunk boundaries."""
    torch.manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": ((64, 16), torch.bfloat16),
        "model.layers.0.input_layernorm.weight": ((16,), torch.float32),
        "model.layers.0.self_attn.q_proj.weight": ((16, 16), torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": ((16,), torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": ((16, 40), torch.bfloat16),
        "model.layers.1.input_layernorm.weight": ((16,), torch.float32),
        "model.layers.1.self_attn.q_proj.weight": ((16, 16), torch.bfloat16),
        "model.layers.1.self_attn.q_proj.bias": ((16,), torch.bfloat16),
        "model.layers.1.mlp.down_proj.weight": ((16, 40), torch.bfloat16),
        "model.norm.weight": ((16,), torch.float32),
        "lm_head.weight": ((64, 16), torch.bfloat16),
    }
    module = torch.nn.Module()
    for name, (shape, dtype) in shapes.items():
        module.register_parameter(name.replace(".", "__"), torch.nn.Parameter(torch.randn(shape).to(dtype)))
    return _Named(module)


class _Named(torch.nn.Module):
    """named_parameters() / state_dict() with the dotted HF names."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def named_parameters(self, *a, **k):
        for name, p in self.inner.named_parameters():
            yield name.replace("__", "."), p

    def state_dict(self, *a, **k):
        return {name: p.detach() for name, p in self.named_parameters()}


def write(out: Path, stem: str, sent, expected, extra: dict) -> None:
    blob, broadcasts = bytearray(), []
    for dtype, numel, raw in sent:
        broadcasts.append({"dtype": dtype, "numel": numel, "offset": len(blob), "nbytes": len(raw)})
        blob += raw
    tensors = []
    for name, t in expected:
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        tensors.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": len(blob), "nbytes": len(raw)})
        blob += raw
    (out / f"{stem}.bin").write_bytes(bytes(blob))
    doc = {"recorded_with": f"torch {torch.__version__}", **extra, "broadcasts": broadcasts, "tensors": tensors}
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")


def record_vllm(vllm_root: Path, out: Path) -> None:
    base = vllm_root / "vllm"
    stub("vllm")
    stub("vllm.distributed")
    stub("vllm.config")
    stub("vllm.config.parallel", ParallelConfig=object)
    stub("vllm.config.weight_transfer", WeightTransferConfig=object)
    stub("vllm.utils")
    stub("vllm.utils.nccl", unpinned_nccl_env=contextlib.nullcontext, find_nccl_library=lambda: "")
    stub("vllm.envs")
    stub("vllm.logger", init_logger=lambda name: __import__("logging").getLogger(name))
    stub("vllm.platforms", current_platform=types.SimpleNamespace(is_rocm=lambda: False))
    stub("vllm.distributed.device_communicators")
    stub("pybase64", b64decode=__import__("base64").b64decode)
    stub("vllm.distributed.weight_transfer")
    wrapper = load("vllm.distributed.device_communicators.pynccl_wrapper",
                   base / "distributed/device_communicators/pynccl_wrapper.py")
    load("vllm.distributed.weight_transfer.base", base / "distributed/weight_transfer/base.py")
    packed = load("vllm.distributed.weight_transfer.packed_tensor", base / "distributed/weight_transfer/packed_tensor.py")
    packed._get_streams = lambda device, n: tuple(_Stream() for _ in range(n))
    load("vllm.distributed.weight_transfer.nccl_common", base / "distributed/weight_transfer/nccl_common.py")
    engine_mod = load("vllm.distributed.weight_transfer.nccl_engine", base / "distributed/weight_transfer/nccl_engine.py")
    source_cls = sys.modules["vllm.distributed.weight_transfer.base"].ModuleSource

    model = tiny_model()
    expected = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    buffer = 1024
    for stem, is_packed in (("vllm_packed", True), ("vllm_unpacked", False)):
        client = _Client()
        engine = engine_mod.NCCLTrainerWeightTransferEngine(
            client=client, source=source_cls(model), packed=is_packed, packed_buffer_size_bytes=buffer,
            packed_num_buffers=2)
        engine.model_update_group = recorder = Recorder()
        engine.send_weights()
        info = client.update_info
        extra = {"producer": "vllm==0.33.0 NCCLTrainerWeightTransferEngine.send_weights",
                 "init_info": {"packed": is_packed, "packed_buffer_size_bytes": buffer, "packed_num_buffers": 2},
                 "update_info": info, "calls": client.calls}
        if is_packed:
            replay = Replayer(recorder.sent)
            metas = ((n, (s, getattr(torch, d))) for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"]))
            chunks: list[list[str]] = []
            packed.packed_nccl_broadcast_consumer(
                iterator=metas, group=replay, src=0, post_unpack_func=_names_into(chunks),
                buffer_size_bytes=buffer, num_buffers=2, device="cpu")
            extra["consumer"] = {"posted": replay.posted, "chunks": chunks}
        write(out, stem, recorder.sent, expected, extra)

    uid = wrapper.ncclUniqueId()
    for i in range(128):
        uid.internal[i] = i - 128 if i >= 64 else i  # c_byte is signed: the bytes 0..63 and 0xc0..0xff
    (out / "uid_vllm_ctypes.pkl").write_bytes(pickle.dumps(uid))
    (out / "uid_raw_bytes.pkl").write_bytes(pickle.dumps(bytes(uid.internal)))


def _names_into(chunks: list):
    return lambda pairs: chunks.append([n for n, _ in pairs])


class _Client:
    def __init__(self):
        self.calls, self.update_info = [], None

    def start_weight_update(self):
        self.calls.append("start_weight_update")

    def update_weights(self, info):
        self.calls.append("update_weights")
        self.update_info = info

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish_weight_update")


def record_primerl(root: Path, out: Path) -> None:
    stub_primerl_imports()
    load("prime_rl.trainer.conversion_utils", root / "prime_rl/trainer/conversion_utils.py")
    nccl = load("prime_rl.transports.weights.nccl", root / "prime_rl/transports/weights/nccl.py")

    # NCCLWeightBroadcastSender.broadcast_weights, on the master rank, in its order
    state_dict = tiny_model().state_dict()
    layer_prefix = "model.layers."
    num_layers = sys.modules["prime_rl.trainer.conversion_utils"].get_max_layer_num(state_dict, layer_prefix)
    recorder = Recorder()
    nccl.broadcast_integer(num_layers + 1, recorder)
    expected = []
    for _layer, layer_state_dict in nccl.filter_state_dict_by_layers(state_dict, num_layers, layer_prefix):
        nccl.broadcast_state_dict(layer_state_dict, recorder)
        by_dtype: dict = {}
        for name, t in layer_state_dict.items():
            by_dtype.setdefault(t.dtype, []).append((name, t.clone()))
        expected += [pair for group in by_dtype.values() for pair in group]  # the receiver's yield order
    # prime-rl's own receiver (inference/vllm/worker/nccl.py), replayed: what it posts and yields
    for name in ("prime_rl.inference", "prime_rl.inference.vllm", "prime_rl.inference.vllm.worker"):
        stub(name)
    stub("prime_rl.inference.vllm.worker.weight_transfer", load_weights_checkpoint_layerwise=None,
         load_weights_kernel=None, update_mla_absorbed_weights=None)
    worker = load("prime_rl.inference.vllm.worker.nccl", root / "prime_rl/inference/vllm/worker/nccl.py")
    replay = Replayer(recorder.sent)
    received = []
    for _ in range(worker.receive_integer(replay)):
        received += [(name, t.clone()) for name, t in worker.receive_state_dict(replay)]
    assert [n for n, _ in received] == [n for n, _ in expected]
    assert all(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
               for (_, a), (_, b) in zip(received, expected))
    write(out, "primerl", recorder.sent, received,
          {"producer": "prime-rl@559b44772e471d1538537b8805cc77f3824a5e64 transports/weights/nccl.py",
           "layers": num_layers, "consumer": {"posted": replay.posted}})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", type=Path, required=True, help="the unpacked vllm==0.33.0 wheel (holds vllm/)")
    parser.add_argument("--prime-rl", type=Path, required=True, help="a directory holding prime_rl/ at @559b447")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cpu_only_cuda()
    args.out.mkdir(parents=True, exist_ok=True)
    record_vllm(args.vllm, args.out)
    record_primerl(args.prime_rl, args.out)


if __name__ == "__main__":
    main()
