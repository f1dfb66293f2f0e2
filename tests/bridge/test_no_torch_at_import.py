"""bridge/ imports torch lazily: every module loads, and the control process runs, without torch imported
(torch lives in the receiver processes only)."""

from __future__ import annotations

import subprocess
import sys


def test_bridge_modules_import_without_torch():
    modules = ["wire", "unpickle", "layout", "libnccl", "nccl", "handoff", "receiver", "sglang_load", "server", "__main__"]
    code = ("import sys; sys.modules['torch'] = None\n"  # an import of torch now raises ImportError
            + "".join(f"import token_proxy.bridge.{m}\n" for m in modules)
            + "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "ok"), out.stderr
