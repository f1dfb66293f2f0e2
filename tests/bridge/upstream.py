"""Loading upstream senders' own source files, unmodified, without installing their packages (torch only).

This module is ours, not upstream's: it puts stand-ins into `sys.modules` for what the upstream files import but
the sending path never calls (a logger factory, config classes used in annotations, a compiled extension), and
loads the upstream files themselves from a directory given by the caller. Used by tests/bridge/record_streams.py
(recording the fixtures on CPU) and tests/e2e/bridge_sender.py (the GPU round's trainer).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path


def stub(name: str, **attrs) -> types.ModuleType:
    """`name` as a bare module holding `attrs`; its parent packages too, where none is there yet."""
    for i in range(1, name.count(".") + 1):
        parent = ".".join(name.split(".")[:i])
        sys.modules.setdefault(parent, types.ModuleType(parent))
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def load(name: str, path: Path) -> types.ModuleType:
    """The upstream file at `path`, executed as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stub_primerl_imports() -> None:
    """What prime-rl@559b447's transports/weights/nccl.py imports beside torch; its broadcast functions
    (broadcast_integer, broadcast_state_dict, filter_state_dict_by_layers) call none of it."""
    for name in ("prime_rl", "prime_rl.configs", "prime_rl.trainer", "prime_rl.utils", "prime_rl.transports",
                 "prime_rl.transports.weights"):
        stub(name)
    stub("vllm.distributed.device_communicators.pynccl", PyNcclCommunicator=object)
    stub("vllm.distributed.utils", StatelessProcessGroup=object)
    stub("vllm.logger", init_logger=lambda name: __import__("logging").getLogger(name))
    stub("prime_rl.configs.trainer", NCCLWeightBroadcastConfig=object)
    stub("prime_rl.trainer.conversion_utils", get_max_layer_num=None)  # record_streams loads the real one
    stub("prime_rl.trainer.models", PreTrainedModelPrimeRL=type("PreTrainedModelPrimeRL", (), {}))
    stub("prime_rl.trainer.utils", get_world=None)
    stub("prime_rl.transports.weights.base", WeightBroadcast=object)
    stub("prime_rl.utils.client", NCCL_READY_MARKER="NCCL_READY")
    stub("prime_rl.utils.logger", get_logger=None)
    stub("prime_rl.utils.nccl", disable_nccl_p2p_if_unavailable=None)
    stub("prime_rl.utils.pathing", sync_wait_for_path=None)
    stub("prime_rl.utils.utils", get_broadcast_dir=None, get_step_path=None)
    stub("prime_rl.utils.vlm", get_layer_prefix=None)


# vLLM's package __init__ files that import the whole engine (models, the scheduler, compiled kernels); the trainer
# engine needs none of it, so these packages are entered without running their __init__
VLLM_BARE_PACKAGES = ("vllm", "vllm.config", "vllm.distributed", "vllm.distributed.weight_transfer",
                      "vllm.distributed.device_communicators")


def enter_vllm(root: str) -> None:
    """Make `import vllm.distributed.weight_transfer.nccl_engine` load vLLM 0.33's own files from `root` (the
    wheel's .py files and its dist-info, .gpu/vllm033py): every module the trainer engine imports is vLLM's,
    unmodified; ours are the bare packages above and a stand-in for `vllm._C_stable_libtorch`, the compiled
    custom ops `vllm.platforms.cuda` imports at its top to register them (the trainer path calls none).
    vllm/__init__.py is not run either (its env_override patches torch inductor; it sets no NCCL variable).

    Built on the dev machine (1 MB; the files the engine imports, checked on CPU with torch 2.13):
        pip download --no-deps vllm==0.33.0 -d /tmp/w && cd /tmp/x && unzip -q /tmp/w/vllm-0.33.0-*.whl \
          'vllm/*.py' 'vllm-0.33.0.dist-info/METADATA' && tar cJf .../.gpu/vllm033py.tar.xz vllm-0.33.0.dist-info \
          vllm/*.py vllm/{config,distributed,platforms,utils,logging_utils,ray,plugins} vllm/third_party/*.py \
          vllm/v1/__init__.py vllm/v1/attention/__init__.py vllm/v1/attention/backends/{__init__,registry}.py
    """
    sys.path.insert(0, root)  # also where importlib.metadata finds vllm's version (its platform detection asks)
    for name in VLLM_BARE_PACKAGES:
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = module
    stub("vllm._C_stable_libtorch")


# What vLLM 0.33's NCCLLibrary binds at construction although its trainer engine never calls it: ncclCommSuspend
# and ncclCommResume (NCCL >= 2.29.7) serve sleep mode only: PyNcclCommunicator.suspend/resume, called by
# parallel_state.suspend_device_comms/resume_device_comms from the worker's sleep/wake_up when
# enable_nccl_comm_suspend is on; suspend() checks has_symbol("ncclCommSuspend") first, and resume() is a no-op
# unless suspended. NCCLLibrary raises on any other missing symbol (on CUDA), and a call to a dropped one would be a
# KeyError in NCCLLibrary._funcs: loud, never a silent change of what is sent.
SLEEP_MODE_ONLY = ("ncclCommSuspend", "ncclCommResume")


def drop_absent_sleep_symbols(library_cls: type, lib: object) -> list[str]:
    """Removes from `library_cls.exported_functions` (vLLM's NCCLLibrary) the SLEEP_MODE_ONLY symbols that `lib`
    (the loaded libnccl, a ctypes.CDLL) lacks; returns their names (none on NCCL >= 2.29.7: nothing changes)."""
    absent = [f.name for f in library_cls.exported_functions if f.name in SLEEP_MODE_ONLY and not hasattr(lib, f.name)]
    library_cls.exported_functions = [f for f in library_cls.exported_functions if f.name not in absent]
    return absent


def fit_vllm_nccl(so_file: str | None = None) -> list[str]:
    """Lets vLLM 0.33's PyNcclCommunicator (after enter_vllm) load an NCCL older than 2.29.7, such as torch 2.11's
    2.28.9 on the GPU host, instead of turning itself off without a word (it catches NCCLLibrary()'s AttributeError
    for ncclCommSuspend and publishes no id): drop_absent_sleep_symbols on the library vLLM would load. Call it
    before the first NCCLLibrary(); returns the dropped names, for the test to print."""
    import ctypes

    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary, find_nccl_library

    return drop_absent_sleep_symbols(NCCLLibrary, ctypes.CDLL(so_file or find_nccl_library()))


def weight_source(tensors: dict):
    """The trainer's weights as vLLM's WeightSource (after enter_vllm): the one piece a trainer writes for vLLM's
    engine (its metadata and full iteration over (name, tensor)); the GPU sender and the CPU dry run share it."""
    import functools

    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Checkpoint(WeightSource):
        def __init__(self, tensors: dict):
            self.tensors = tensors

        @functools.cached_property
        def metadata(self) -> list:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]

        def iter_full(self):
            yield from self.tensors.items()

    return Checkpoint(tensors)
