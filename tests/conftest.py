"""Shared fixtures: a real Qwen2 BPE tokenizer built offline (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from token_proxy.simulator.builtin_tokenizer import ensure_builtin_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The built-in Qwen2.5-layout tokenizer with a ChatML template (built once per session)."""
    return ensure_builtin_tokenizer(tmp_path_factory.getbasetemp() / "qwen2-tokenizer")


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def hf_fast_bpe(hf_tokenizer):
    """The test tokenizer's proven tiktoken twin (built once: the proof takes ~1.2 s); None without tiktoken
    (tests/pipeline/test_fast_bpe.py then fails, the rest run on the tokenizer's encoder)."""
    from token_proxy.tokenization.fast_bpe import build_fast_bpe

    return build_fast_bpe(hf_tokenizer)[0]


@pytest.fixture
def shared_tokenizer(monkeypatch, hf_tokenizer, hf_fast_bpe):
    """Every proxy app in a test session reuses one loaded tokenizer (loading takes ~2 s) and its twin."""
    monkeypatch.setattr("token_proxy.sglang.discovery.load_tokenizer", lambda path: hf_tokenizer)
    monkeypatch.setattr("token_proxy.sglang.discovery.load_fast_bpe",
                        lambda tokenizer: hf_fast_bpe if tokenizer is hf_tokenizer else None)
    return hf_tokenizer


@pytest.fixture
def make_sim(aiohttp_server, tokenizer_dir):
    """Start a simulator: `sim = await make_sim(**SimConfig overrides)`; sim.app[SIM_STATE] is its state."""
    from token_proxy.simulator import SimConfig, create_sim_app

    async def factory(**overrides):
        # Deterministic inference by default: many tests compare seeded requests (SGLang ignores
        # seeds without it, and the proxy then reports them unhonoured; tests/pipeline/test_seed.py covers that).
        overrides.setdefault("enable_deterministic_inference", True)
        config = SimConfig(tokenizer_path=str(tokenizer_dir), **overrides)
        return await aiohttp_server(create_sim_app(config))

    return factory


@pytest.fixture
def make_proxy(aiohttp_client, shared_tokenizer, tokenizer_dir):
    """A proxy test client in front of `backend` (a started server or a URL)."""
    from token_proxy.app import create_app
    from token_proxy.settings import Settings
    from token_proxy.sglang.discovery import wait_until_connected

    async def factory(backend, **overrides):
        url = backend if isinstance(backend, str) else str(backend.make_url("")).rstrip("/")
        overrides.setdefault("backend_wait_s", 5.0)
        settings = Settings(backend_url=url, tokenizer=str(tokenizer_dir), **overrides)
        client = await aiohttp_client(create_app(settings))
        # The port opens at once; tests mostly want the connected proxy (bounded by backend_wait_s).
        await wait_until_connected(client.app, settings.backend_wait_s)
        return client

    return factory


@pytest.fixture
async def sim(make_sim):
    return await make_sim()


@pytest.fixture
async def proxy(make_proxy, sim):
    return await make_proxy(sim)
