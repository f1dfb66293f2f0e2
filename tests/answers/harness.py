"""Run the answer cases (cases.py) against the proxy app in-process, in front of the built-in SGLang
simulator (or, for the golden setup, real SGLang's recorded /generate replies: golden_replay.py), and
normalize what comes back: the recorder (record.py) writes the result, the test (test_answers_unchanged.py)
compares with it.

Every setup is a fresh simulator (deterministic inference, sampled requests carry seeds) and a fresh proxy,
started in this process on local ports (nothing leaves the machine). The cases of one setup run in order on
the same pair, so a session continuation sees its first turn.
"""

from __future__ import annotations

import base64
import functools
import re
from pathlib import Path
from unittest import mock

import orjson
from aiohttp.test_utils import TestClient, TestServer

from tests.answers import golden_replay
from tests.answers.cases import CASES, SETUPS, Case, Request

# The response headers an answer is compared on (when present): the rest are aiohttp's (Date, Server;
# Content-Length follows the body).
HEADERS = ("Content-Type", "X-Request-Id", "X-Session-Continuity", "Allow", "WWW-Authenticate", "Retry-After")

# The volatile parts of an answer, found in its raw bytes (JSON bodies, SSE `data:` lines and header values
# alike; orjson writes compact JSON, so `"key":value` has no space). Only each match's volatile value is
# replaced; key order, spacing and every other byte stay as the proxy wrote them:
#   - the ids the proxy draws: uuid4 hex (32 digits) standing alone or after a prefix (chatcmpl-, cmpl-,
#     generate-tokens-), in bodies and X-Request-Id; each distinct value becomes <id1>, <id2>, ... in order of
#     first appearance within one answer, so a stream whose chunks stop sharing one id still differs;
#   - vLLM's tool-call ids (chatcmpl-tool- + 16 random hex digits), numbered the same way (<tool1>, ...);
#   - `created` (Unix seconds: the request's, or the proxy's start for /v1/models) becomes 0;
#   - the run's own paths (`paths`: the temporary tokenizer folder /v1/models names as `root`).
# Nothing else in the proxy's answers varies between runs (check: record twice, compare the files).
_IDS = re.compile(rb"(?<![0-9A-Za-z])([0-9a-f]{32})(?![0-9A-Za-z])")
_TOOL_IDS = re.compile(rb"(?<=chatcmpl-tool-)([0-9a-f]{16})(?![0-9A-Za-z])")
_CREATED = re.compile(rb'(?<="created":)(\d+)')
# The bound on each setup's connect (it returns as soon as the proxy is connected, ~1 s when idle): loading
# the tokenizer and importing transformers on a loaded 2-core machine took over the 10 s this once was.
CONNECT_WAIT_S = 60.0


def normalize(*parts: bytes, paths: dict[str, str] | None = None) -> list[bytes]:
    """The parts of one answer (header values, body) with their volatile values replaced by placeholders
    (see above), ids numbered across the parts; every other byte kept."""
    tool_ids: dict[bytes, bytes] = {}
    ids: dict[bytes, bytes] = {}

    def number(seen: dict[bytes, bytes], label: bytes):
        return lambda m: seen.setdefault(m.group(1), b"<%s%d>" % (label, len(seen) + 1))

    out = []
    for part in parts:
        for path, placeholder in (paths or {}).items():
            part = part.replace(orjson.dumps(path)[1:-1], placeholder.encode())
        part = _CREATED.sub(b"0", part)
        part = _TOOL_IDS.sub(number(tool_ids, b"tool"), part)
        out.append(_IDS.sub(number(ids, b"id"), part))
    return out


def as_text(body: bytes) -> str | dict:
    """The body as stored: its text when UTF-8 (every answer the proxy writes), else {"base64": ...}."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(body).decode("ascii")}


async def _send(client: TestClient, request: Request, paths: dict[str, str]) -> dict:
    data = request.raw if request.raw is not None else (
        None if request.json is None else orjson.dumps(request.json))
    headers = {"Content-Type": "application/json"} if data is not None else {}
    headers.update(request.headers)
    async with client.request(request.method, request.path, data=data, headers=headers,
                              params=request.params) as resp:
        names = [name for name in HEADERS if name in resp.headers]
        *values, body = normalize(*(resp.headers[name].encode() for name in names), await resp.read(), paths=paths)
        return {"status": resp.status, "headers": {name: value.decode() for name, value in zip(names, values)},
                "body": as_text(body)}


async def _setup(name: str, tokenizer_dir: Path):
    from token_proxy.app import create_app
    from token_proxy.settings import Settings
    from token_proxy.sglang.discovery import CONNECTION, wait_until_connected
    from token_proxy.simulator import SimConfig, create_sim_app

    setup = SETUPS[name]
    sim_app = create_sim_app(SimConfig(tokenizer_path=str(tokenizer_dir), enable_deterministic_inference=True,
                                       keep_alive_s=0.0, **setup.sim))
    if setup.golden:
        sim_app.middlewares.insert(0, golden_replay.replay_generate)
    sim = TestServer(sim_app)
    await sim.start_server()
    url = str(sim.make_url("")).rstrip("/")
    settings = Settings(backend_url=url, tokenizer=str(tokenizer_dir), backend_wait_s=10.0, **setup.proxy)
    client = TestClient(TestServer(create_app(settings)))
    await client.start_server()
    if not await wait_until_connected(client.app, CONNECT_WAIT_S):
        conn = client.app[CONNECTION]
        await client.close()  # closed here, or the loop's end finds both open (asyncio's athrow() errors)
        await sim.close()
        raise RuntimeError(f"setup {name}: the proxy did not connect to the simulator at {url} in "
                           f"{CONNECT_WAIT_S:g} s: {conn.fatal or conn.last_error}")
    return sim, client


async def run_cases(tokenizer_dir: Path, cases: tuple[Case, ...] = CASES) -> dict[str, dict]:
    """{case name: {"setup", "requests": [the requests sent], "answers": [status, headers, normalized body]}},
    in case order; the cases of each setup run in order on one simulator + proxy pair."""
    from token_proxy.sglang import discovery

    results: dict[str, dict] = {}
    # Every proxy loads its tokenizer through the product's loader, once per run (loading takes ~1 s; the
    # proxies share one loaded tokenizer, as conftest's shared_tokenizer has every test's proxies do), and
    # proves its tiktoken twin the product's way, once per run too (the proof takes ~2 s, four setups).
    with mock.patch.object(discovery, "load_tokenizer", functools.cache(discovery.load_tokenizer)), \
            mock.patch.object(discovery, "load_fast_bpe", functools.cache(discovery.load_fast_bpe)):
        for setup in SETUPS:
            await _run_setup(setup, [case for case in cases if case.setup == setup], tokenizer_dir, results)
    return {case.name: results[case.name] for case in cases if case.name in results}


async def _run_setup(setup: str, mine: list[Case], tokenizer_dir: Path, results: dict[str, dict]) -> None:
    """The cases of one setup, in order, on one fresh simulator + proxy pair."""
    if not mine or (SETUPS[setup].golden and not golden_replay.available()):
        return  # without ../shared/golden the golden cases are left out (the test skips them)
    sim, client = await _setup(setup, tokenizer_dir)
    try:
        for case in mine:
            sent, answers = [], []
            for step in case.steps:
                request = step(answers) if callable(step) else step
                sent.append(_describe(request))
                answers.append(await _send(client, request, {str(tokenizer_dir): "<tokenizer_dir>"}))
            results[case.name] = {"setup": setup, "requests": sent, "answers": answers}
    finally:
        await client.close()
        await sim.close()


def _describe(request: Request) -> dict:
    out = {"method": request.method, "path": request.path}
    if request.params:
        out["params"] = request.params
    if request.headers:
        out["headers"] = request.headers
    if request.raw is not None:
        out["raw"] = request.raw.decode("utf-8", "replace")
    elif request.json is not None:
        out["json"] = request.json
    return out


