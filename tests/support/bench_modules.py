"""bench/ scripts loaded as modules (bench/ is not a package): one loader for the tests of bench tools."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = next(p for p in Path(__file__).resolve().parents if (p / "bench").is_dir()) / "bench"


def load_bench_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
