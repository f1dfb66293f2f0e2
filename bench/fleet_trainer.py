"""The trainer process of bench/fleet_round.py: one long-lived process, as a real trainer is, that joins
SGLang's weight-update group and pushes through token_proxy.broadcast, driven by JSON lines on stdin.

    python bench/fleet_trainer.py --url http://127.0.0.1:8000 --weights /tmp/tiny-qwen2 --backend nccl --device cuda
    python bench/fleet_trainer.py --url http://127.0.0.1:8000 --weights sim --backend gloo   # the simulator's params

Each command is one JSON object on a line; each answer one line starting with "@@ " and a JSON object
{"ok": bool, "error": str, "seconds": float, ...}. Commands ("op"):
  env                                     torch / NCCL versions and NCCL_CUMEM_ENABLE as this process sees it
  init {port, group, world, announce, url} SGLangBroadcaster.init (announce false: prime-rl's /init_broadcaster joins);
                                          url: the proxy this group's pushes go through (default --url)
  push {version, mode}                    update(): mode perturb (new values), restore (the checkpoint's), wrong
                                          (a wrong shape in the middle of the model: SGLang refuses it)
  close {announce}                        close(); errors reported, the local group left in any case
  vllm_init {port, world}                 SGLangTrainerWeightTransferEngine.trainer_init (vLLM's drop-in)
  vllm_send {version, mode}, vllm_shutdown
  save {dir, seed}                        a checkpoint: the model directory with perturbed tensors (disk phase)
The process runs with the environment it was given: nothing here sets NCCL variables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback


def load_weights(source: str) -> dict:
    import torch

    if source == "sim":
        from token_proxy.simulator.params import PARAM_SHAPES

        return {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in PARAM_SHAPES.items()}
    from safetensors.torch import load_file

    weights = {}
    for name in sorted(os.listdir(source)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(source, name)))
    if not weights:
        raise SystemExit(f"no *.safetensors under {source}")
    return weights


def variant(weights: dict, mode: str, seed: int) -> list:
    """(name, tensor) pairs in the checkpoint's order."""
    import torch

    if mode == "restore":
        return list(weights.items())
    generator = torch.Generator().manual_seed(seed)
    pairs = [(name, (t.float() + 0.01 * torch.randn(t.shape, generator=generator)).to(t.dtype))
             for name, t in weights.items()]
    if mode == "wrong":  # a 1-D tensor (a norm: SGLang's default loader asserts its size) in the middle
        flat = [i for i, (_, t) in enumerate(pairs) if t.dim() == 1] or list(range(len(pairs)))
        middle = flat[len(flat) // 2]
        name, tensor = pairs[middle]
        pairs[middle] = (name, torch.ones((tensor.shape[0] + 1, *tensor.shape[1:]), dtype=tensor.dtype))
    return pairs


class Trainer:
    def __init__(self, args):
        self.args = args
        self.weights = load_weights(args.weights)
        self.caster = None
        self.engine = None

    def env(self, _cmd) -> dict:
        import torch

        nccl = None
        if torch.cuda.is_available():
            try:
                nccl = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception as exc:  # noqa: BLE001
                nccl = f"unknown: {exc}"
        return {"torch": torch.__version__, "nccl": nccl, "cuda": torch.cuda.is_available(),
                "NCCL_CUMEM_ENABLE": os.environ.get("NCCL_CUMEM_ENABLE"),
                "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "tensors": len(self.weights)}

    def _caster(self, cmd):
        from token_proxy.broadcast import SGLangBroadcaster

        return SGLangBroadcaster(url=cmd.get("url") or self.args.url, master_address="127.0.0.1", master_port=int(cmd["port"]),
                                 inference_world_size=int(cmd["world"]), group_name=cmd.get("group", "weight_update_group"),
                                 backend=self.args.backend, device=self.args.device, timeout_s=self.args.timeout)

    def init(self, cmd) -> dict:
        self.caster = self._caster(cmd)
        self.caster.init(announce=bool(cmd.get("announce", True)))
        return {}

    def push(self, cmd) -> dict:
        if self.caster is None:
            raise RuntimeError("push before init")
        pairs = variant(self.weights, cmd.get("mode", "perturb"), int(cmd.get("seed", 1)))
        return {"buckets": self.caster.update(pairs, cmd.get("version"))}

    def close(self, cmd) -> dict:
        caster, self.caster = self.caster, None
        if caster is not None:
            caster.close(announce=bool(cmd.get("announce", True)))
        return {}

    def vllm_init(self, cmd) -> dict:
        from token_proxy.broadcast.vllm_engine import SGLangTrainerWeightTransferEngine

        info = {"master_address": "127.0.0.1", "master_port": int(cmd["port"]), "world_size": int(cmd["world"]) + 1,
                "rank": 0}
        self.engine = SGLangTrainerWeightTransferEngine.trainer_init(
            info, client=self.args.url, source=[], backend=self.args.backend, timeout_s=self.args.timeout)
        if self.args.device:
            self.engine.broadcaster.device = self.args.device
        return {}

    def vllm_send(self, cmd) -> dict:
        if self.engine is None:
            raise RuntimeError("vllm_send before vllm_init")
        self.engine.source = variant(self.weights, cmd.get("mode", "perturb"), int(cmd.get("seed", 2)))
        return {"buckets": self.engine.send_weights(cmd.get("version"))}

    def vllm_shutdown(self, _cmd) -> dict:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
        return {}

    def save(self, cmd) -> dict:
        from safetensors.torch import save_file

        out = cmd["dir"]
        if self.args.weights != "sim":
            shutil.copytree(self.args.weights, out, dirs_exist_ok=True)
            for name in os.listdir(out):
                if name.endswith(".safetensors"):
                    os.remove(os.path.join(out, name))
        os.makedirs(out, exist_ok=True)
        pairs = variant(self.weights, "perturb", int(cmd.get("seed", 3)))
        save_file({name: t.contiguous() for name, t in pairs}, os.path.join(out, "model.safetensors"))
        return {"dir": out}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the proxy")
    parser.add_argument("--weights", required=True, help="a model directory (*.safetensors), or 'sim'")
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--device", default=None, help="cuda for NCCL; none: CPU tensors (gloo)")
    parser.add_argument("--timeout", type=float, default=60.0, help="the broadcaster's timeout_s")
    args = parser.parse_args(argv)
    trainer = Trainer(args)
    print("@@ " + json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        started = time.monotonic()
        try:
            reply = {"ok": True, **getattr(trainer, cmd["op"])(cmd)}
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the driver, which goes on
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                     "trace": traceback.format_exc()[-1500:]}
        reply["seconds"] = round(time.monotonic() - started, 3)
        print("@@ " + json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
