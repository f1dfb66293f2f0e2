"""A package's face: `__all__` names its public door, and each name is loaded from its module on first
use (PEP 562), so importing one module of a package never imports the rest: start-up stays cheap, the
simulator's few imports stay few, and a package's modules never meet an import cycle through their face.

    __all__ = ["run_pipeline"]
    __getattr__ = door(__name__, {"run_pipeline": "run"})   # name -> its module in the package
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module


def door(package: str, names: dict[str, str]) -> Callable[[str], object]:
    """The package's `__getattr__`: a door name -> the object of that name in its module."""

    def lookup(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{module}"), name)

    return lookup
