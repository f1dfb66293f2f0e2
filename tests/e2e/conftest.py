"""Fixtures for the end-to-end suite against a live SGLang server (SGLANG_URL); skipped without one."""

from __future__ import annotations

import json
import os
import urllib.request

import aiohttp
import pytest

SGLANG_URL = os.environ.get("SGLANG_URL", "").rstrip("/")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)
            if not SGLANG_URL:
                item.add_marker(pytest.mark.skip(reason="set SGLANG_URL to run against a live SGLang server"))


@pytest.fixture(scope="session")
def sglang_url() -> str:
    return SGLANG_URL


@pytest.fixture(scope="session")
def live_tokenizer(sglang_url):
    """The tokenizer SGLang itself serves with (its /model_info tokenizer_path), loaded once."""
    from transformers import AutoTokenizer

    with urllib.request.urlopen(f"{sglang_url}/model_info", timeout=10) as resp:
        info = json.load(resp)
    return AutoTokenizer.from_pretrained(info["tokenizer_path"])


@pytest.fixture
def live_proxy(aiohttp_client, monkeypatch, live_tokenizer, sglang_url):
    from token_proxy.app import create_app
    from token_proxy.settings import Settings
    from token_proxy.sglang.discovery import wait_until_connected

    monkeypatch.setattr("token_proxy.sglang.discovery.load_tokenizer", lambda path: live_tokenizer)

    async def factory(**overrides):
        settings = Settings(backend_url=sglang_url, backend_wait_s=60.0, **overrides)
        client = await aiohttp_client(create_app(settings))
        await wait_until_connected(client.app, settings.backend_wait_s)
        return client

    return factory


@pytest.fixture
async def proxy(live_proxy):
    return await live_proxy()


class DirectSGLang:
    """Calls to SGLang itself, next to the proxy, for comparison."""

    def __init__(self, session: aiohttp.ClientSession, url: str):
        self.session, self.url = session, url

    async def post(self, path: str, body: dict) -> tuple[int, object]:
        async with self.session.post(self.url + path, json=body) as resp:
            raw = await resp.read()
            try:
                return resp.status, json.loads(raw)
            except ValueError:
                return resp.status, raw.decode("utf-8", "replace")

    async def get(self, path: str) -> tuple[int, object]:
        async with self.session.get(self.url + path) as resp:
            raw = await resp.read()
            try:
                return resp.status, json.loads(raw) if raw else None
            except ValueError:
                return resp.status, raw.decode("utf-8", "replace")


@pytest.fixture
async def sglang(sglang_url):
    async with aiohttp.ClientSession() as session:
        yield DirectSGLang(session, sglang_url)


# A short greedy chat, to check that SGLang still generates (and generates the same) after an admin sequence.
CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "temperature": 0,
        "return_token_ids": True}


@pytest.fixture
async def memory_saver(sglang, proxy):
    """Skips unless SGLang runs with --enable-memory-saver --enable-weights-cpu-backup. A failed test must not
    leave SGLang asleep for the next ones: only the proxy that put it to sleep knows what it released, and a
    bare /wake_up brings back all of it."""
    _, info = await sglang.get("/server_info")
    if not (info.get("enable_memory_saver") and info.get("enable_weights_cpu_backup")):
        pytest.skip("start SGLang with --enable-memory-saver --enable-weights-cpu-backup")
    yield
    await proxy.post("/wake_up")
