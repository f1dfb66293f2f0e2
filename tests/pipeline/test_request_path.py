"""Which token_proxy modules one plain chat runs (issue 21): no tools, no session, no LoRA, through the app
over the simulator, streamed and not. The sets must equal ARCHITECTURE.md's table "Modules one plain chat
runs", so the map a newcomer reads is the code that runs. The count is documentation, not a target (issue 36)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import token_proxy
from tests.support.module_trace import ModuleTrace, Probe
from token_proxy.app import create_app
from token_proxy.settings import Settings
from token_proxy.sglang.discovery import wait_until_connected

ARCHITECTURE = Path(__file__).resolve().parents[2] / "ARCHITECTURE.md"
HEADING = "## Modules one plain chat runs"
PACKAGE = Path(token_proxy.__file__).resolve().parent
BODY = {"model": "sim/qwen2-tiny", "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": 8}


def architecture_table() -> dict[str, set[str]]:
    """The table's columns: `plain` and `stream` (handler -> SGLang -> response), `middleware` (the
    middleware chain around it; with middleware a chat runs its column's modules plus these)."""
    section = ARCHITECTURE.read_text().split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| *(x?) *\| *(x?) *\| *(x?) *\|", section, re.MULTILINE)
    assert rows, f"no rows under {HEADING!r} in ARCHITECTURE.md"
    return {column: {module for module, *marks in rows if marks[i] == "x"}
            for i, column in enumerate(("plain", "stream", "middleware"))}


@pytest.fixture
async def traced_proxy(aiohttp_client, shared_tokenizer, tokenizer_dir, sim):
    probe = Probe()
    settings = Settings(backend_url=str(sim.make_url("")).rstrip("/"), tokenizer=str(tokenizer_dir),
                        backend_wait_s=5.0)
    app = create_app(settings)
    probe.install(app)
    client = await aiohttp_client(app)
    await wait_until_connected(client.app, settings.backend_wait_s)
    for stream in (False, True, False, True):  # warm: lazy imports, caches and pools are not per request
        await chat(client, stream)
    return client, probe


async def chat(client, stream: bool) -> bytes:
    reply = await client.post("/v1/chat/completions", json={**BODY, "stream": stream})
    data = await reply.read()
    assert reply.status == 200, data
    return data


async def modules_run(client, probe: Probe, where: str, stream: bool) -> set[str]:
    trace = ModuleTrace(PACKAGE, exclude=("simulator/",))
    probe.trace, probe.where = trace, where
    try:
        with trace.recording():
            data = await chat(client, stream)
    finally:
        probe.trace = probe.where = None
    assert data.endswith(b"data: [DONE]\n\n") if stream else data.startswith(b'{"id":"chatcmpl-')
    return trace.modules()


async def test_a_plain_chat_runs_the_modules_architecture_lists(traced_proxy):
    client, probe = traced_proxy
    table = architecture_table()
    ran = {(where, stream): await modules_run(client, probe, where, stream)
           for where in ("handler", "app") for stream in (False, True)}
    for (where, stream), modules in ran.items():
        print(f"\n{where:7} {'streamed' if stream else 'non-streamed':12} {len(modules):2} modules: "
              f"{' '.join(sorted(modules))}")
    assert ran["handler", False] == table["plain"]
    assert ran["handler", True] == table["stream"]
    assert ran["app", False] == table["plain"] | table["middleware"]
    assert ran["app", True] == table["stream"] | table["middleware"]


def test_every_path_architecture_names_exists():
    """Issue 29: every `dir/....py` path ARCHITECTURE.md names (relative to token_proxy/, or to the repository
    for tests/ and bench/) is a real file, so the map never sends a newcomer to a renamed module."""
    root = ARCHITECTURE.parent
    named = set(re.findall(r"(?<![\w<>/.-])((?:[\w-]+/)+[\w-]+\.py)\b", ARCHITECTURE.read_text()))
    missing = sorted(path for path in named
                     if not (PACKAGE / path).is_file() and not (root / path).is_file())
    assert len(named) > 60 and missing == []
