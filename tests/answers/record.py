"""Record the proxy's answers to every case in cases.py into answers.json (see test_answers_unchanged.py).

    PYTHONPATH=$PWD .venv/bin/python -m tests.answers.record

Run it only after an intended change to an answer, and commit answers.json with that change.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

from tests.answers import golden_replay
from tests.answers.harness import run_cases
from tests.support.golden import ENV, candidates
from token_proxy.simulator.builtin_tokenizer import ensure_builtin_tokenizer

FIXTURE = Path(__file__).with_name("answers.json")


def dumps(results: dict) -> str:
    """The fixture's text: one case per key, indented, non-ASCII kept (answers are compared as text)."""
    return json.dumps(results, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else FIXTURE
    if not golden_replay.available():
        print(f"record: the golden SGLang recordings are not here ({', '.join(map(str, candidates()))}); set "
              f"{ENV} to the folder holding {' and '.join(golden_replay.FILES)}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = ensure_builtin_tokenizer(Path(tmp) / "qwen2-tokenizer")
        results = asyncio.run(run_cases(tokenizer_dir))
    out.write_text(dumps(results), encoding="utf-8")
    print(f"recorded {len(results)} cases into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
