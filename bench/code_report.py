"""The package's size and complexity, reported (issue 36: meters report; they never decide where code goes).

Prints the package's lines and modules, the largest modules, and ruff's McCabe complexity of every function
over `--complexity` (ruff's C901, report-only: `--exit-zero`). CI prints it after the tests; nothing fails on
a number here.

    python bench/code_report.py [--top 10] [--complexity 15]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "token_proxy"


def module_sizes() -> dict[str, int]:
    return {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}


def complexity_lines(over: int) -> list[str]:
    """ruff's C901 findings (functions over `over`), one line each; ruff is the lint tool `make lint` installs."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    command = [ruff, "check", str(PACKAGE), "--select", "C901", "--exit-zero", "--output-format", "concise",
               "--config", f"lint.mccabe.max-complexity={over}"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"(ruff did not run: {exc})"]
    return [line.replace(str(ROOT) + "/", "") for line in result.stdout.splitlines() if "C901" in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=10, help="how many of the largest modules to list")
    parser.add_argument("--complexity", type=int, default=15, help="list functions over this McCabe complexity")
    args = parser.parse_args()
    sizes = module_sizes()
    print(f"token_proxy: {sum(sizes.values())} lines in {len(sizes)} modules")
    print("| lines | module |\n|---:|---|")
    for path, lines in sorted(sizes.items(), key=lambda row: -row[1])[: args.top]:
        print(f"| {lines} | `{path}` |")
    found = complexity_lines(args.complexity)
    print(f"\nfunctions over McCabe complexity {args.complexity} (ruff C901, report only): {len(found)}")
    for line in found:
        print(f"  {line}")


if __name__ == "__main__":
    main()
