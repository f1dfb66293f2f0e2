"""The golden SGLang 0.5.17 recordings, for every test that reads them: $TOKEN_PROXY_GOLDEN_DIR, else
../shared/golden beside the checkout (for a git worktree, beside its main checkout too).

Absent, a test that needs them is skipped with the reason; under CI (the env var CI set), where ../shared
is always beside the checkout, it fails instead: a missing recording must not pass as a skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENV = "TOKEN_PROXY_GOLDEN_DIR"
ROOT = Path(__file__).resolve().parents[2]


def candidates() -> list[Path]:
    if os.environ.get(ENV):
        return [Path(os.environ[ENV])]
    roots = [ROOT]
    git = ROOT / ".git"
    if git.is_file() and git.read_text().startswith("gitdir:"):  # a worktree: .git names its git dir
        gitdir = Path(git.read_text().split(":", 1)[1].strip())
        common = gitdir / "commondir"
        if common.is_file():
            roots.append((gitdir / common.read_text().strip()).resolve().parent)
    return [root.parent / "shared" / "golden" for root in roots]


def golden_file(name: str, *, optional: bool = False) -> Path | None:
    """The recording `name`; when it is not here: None if `optional`, else the caller is skipped (module
    level too). Under CI a missing recording fails either way."""
    for directory in candidates():
        if (directory / name).is_file():
            return directory / name
    reason = f"the golden SGLang recordings are not here ({name} in {' or '.join(map(str, candidates()))}; set {ENV})"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI always has ../shared beside the checkout", pytrace=False)
    if optional:
        return None
    pytest.skip(reason, allow_module_level=True)
