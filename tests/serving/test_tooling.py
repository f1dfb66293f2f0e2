"""The Makefile and CI as a newcomer meets them: `make run` and `make test` side by side, CI running the
README's command without torch first, and lower bounds that are really tested."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(target: str, tmp_path) -> str:
    venv = tmp_path / "venv"
    result = subprocess.run(["make", "-n", "-C", str(ROOT), target, f"VENV={venv}"], capture_output=True,
                            text=True, check=False, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_make_run_installs_only_runtime_dependencies_and_says_so(tmp_path):
    commands = dry_run("run", tmp_path)
    installs = [line for line in commands.splitlines() if "pip install" in line]
    assert installs and all("[test" not in line and "bench" not in line for line in installs)
    assert re.search(r"echo .*installing", commands)


def test_make_run_and_make_test_install_under_one_lock(tmp_path):
    for target in ("run", "test"):
        commands = dry_run(target, tmp_path)
        install = next(line for line in commands.splitlines() if "fcntl" in line)
        assert "flock" in install and f"{tmp_path / 'venv'}.lock" in install and "-m venv" in install


def test_ci_runs_the_readme_command_without_torch_before_the_torch_tests():
    commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    make_test = commands.index("make test")
    torch = next(i for i, line in enumerate(commands) if "torch==" in line and "pip install" in line)
    assert make_test < torch
    assert any(line.startswith("make clean") for line in commands[:make_test])  # a fresh .venv


def test_lower_bounds_are_the_floors_of_pyproject():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for requirement in project["dependencies"]:
        name, floor = re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement).groups()
        floors[name.lower()] = floor
    pins = dict(line.split("==") for line in (ROOT / ".ci" / "lower-bounds.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert {name: version.removesuffix(".0") for name, version in pins.items()} == \
        {name: version.removesuffix(".0") for name, version in floors.items()}


PACKAGES = ("admin", "fleet", "api", "cli", "api.chat", "api.completions", "api.generate", "api.tokenize", "lora", "ops",
            "pipeline", "serving", "sglang", "sessions", "simulator", "tokenization", "tools", "broadcast")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_face_says_what_it_holds_and_its_door_opens(package):
    """Issue 29: each package's __init__ has a docstring (not issue 21's placeholder) and an `__all__`
    whose every name is reachable through the face; issue 36: one face style, every name imported eagerly
    (no module-level `__getattr__`)."""
    face = importlib.import_module(f"token_proxy.{package}")
    assert face.__doc__ and "issue 21 layout" not in face.__doc__, package
    assert face.__all__, package
    assert "__getattr__" not in vars(face), package
    for name in face.__all__:
        assert name in vars(face) and vars(face)[name] is not None, (package, name)


def test_tests_import_a_public_name_through_its_face():
    """Issue 29: a name a package's face exports (`__all__`) is imported from the face, not from the module
    behind it; a test of a module's internals imports the module (its other names are on no face)."""
    import ast

    faces = {f"token_proxy.{package}": importlib.import_module(f"token_proxy.{package}") for package in PACKAGES}
    deep = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.module in faces or not node.module \
                    or not node.module.startswith("token_proxy."):
                continue
            above = [face for name, face in faces.items() if node.module.startswith(name + ".")]
            for alias in node.names:  # the same object on a face (healthcheck's own `main` is not cli's)
                if any(alias.name in face.__all__ and getattr(face, alias.name) is
                       getattr(importlib.import_module(node.module), alias.name, None) for face in above):
                    deep.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{alias.name}")
    assert deep == []
