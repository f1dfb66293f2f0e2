"""A tokenizer from another model cannot be served silently (issue 39 item 2): a probe text is encoded by the proxy
and by SGLang's /v1/tokenize at start-up and when SGLang answers again after an outage; different ids are a
fatal start-up error naming both tokenizers, unless --allow-tokenizer-mismatch."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from tests.support.admin_fixtures import free_port, http_status
from token_proxy.app import create_app
from token_proxy.settings import Settings
from token_proxy.sglang import config_checks as tokenizer_check
from token_proxy.sglang.discovery import CONNECTION, ON_FATAL, wait_until_connected
from token_proxy.simulator import SIM_STATE, SimConfig, create_sim_app

OTHER_TEXT = ["the cat sat on the mat", "a small vocabulary from another model", "hello world 42"] * 20


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory) -> Path:
    return build_other_tokenizer(tmp_path_factory.mktemp("other-tokenizer"))


def build_other_tokenizer(directory: Path) -> Path:
    """A byte-level BPE of 300 tokens and its own eos after them (301): another model's tokenizer, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(OTHER_TEXT, trainer)
    tokenizer.add_special_tokens(["<|endoftext|>"])  # after the BPE ids, as Qwen's and Llama's are
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "model_max_length": 512}))
    return directory


async def proxy_app(aiohttp_client, backend, **overrides):
    url = str(backend.make_url("")).rstrip("/")
    app = create_app(Settings(backend_url=url, backend_wait_s=5.0, **overrides))
    fatal: list[str] = []
    app[ON_FATAL] = fatal.append
    client = await aiohttp_client(app)
    await wait_until_connected(app, 30)
    return client, app[CONNECTION], fatal


async def test_another_models_tokenizer_is_a_fatal_start_up_error_naming_both(make_sim, aiohttp_client,
                                                                              other_tokenizer_dir, tokenizer_dir):
    sim = await make_sim()
    client, conn, fatal = await proxy_app(aiohttp_client, sim, tokenizer=str(other_tokenizer_dir))
    assert conn.connected is None
    assert fatal == [conn.fatal]
    line = conn.fatal
    assert line.startswith(f"the proxy's tokenizer '{other_tokenizer_dir}' (301 tokens, eos '<|endoftext|>') is not "
                           f"SGLang's ('{tokenizer_dir}', /model_info's tokenizer_path): a probe text is ")
    assert line.endswith(f"Pass --tokenizer with SGLang's tokenizer ({tokenizer_dir}), or --allow-tokenizer-mismatch "
                         "if you know the ids agree")
    assert "\n" not in line
    resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 503
    assert "is not SGLang's" in (await resp.json())["error"]["message"]
    assert sim.app[SIM_STATE].received == []  # nothing was generated on the wrong ids


async def test_the_simulator_on_another_tokenizer_is_caught_too(aiohttp_server, aiohttp_client, other_tokenizer_dir,
                                                                tokenizer_dir):
    """The simulator runs on any tokenizer.json; the proxy on the Qwen2 one."""
    sim = await aiohttp_server(create_sim_app(SimConfig(tokenizer_path=str(other_tokenizer_dir))))
    _, conn, fatal = await proxy_app(aiohttp_client, sim, tokenizer=str(tokenizer_dir))
    assert conn.connected is None and len(fatal) == 1
    assert fatal[0].startswith(f"the proxy's tokenizer '{tokenizer_dir}' (151665 tokens, eos '<|im_end|>') is not "
                               f"SGLang's ('{other_tokenizer_dir}',")


async def test_allow_tokenizer_mismatch_serves_with_a_warning(make_sim, aiohttp_client, other_tokenizer_dir, caplog):
    caplog.set_level(logging.WARNING, "token_proxy.sglang.config_checks")
    _, conn, fatal = await proxy_app(aiohttp_client, await make_sim(), tokenizer=str(other_tokenizer_dir),
                                     allow_tokenizer_mismatch=True)
    assert conn.connected is not None and fatal == []
    (warning,) = [r.getMessage() for r in caplog.records if "is not SGLang's" in r.getMessage()]
    assert warning.endswith("(served all the same: --allow-tokenizer-mismatch)")


async def test_sglangs_own_tokenizer_passes_and_the_probe_holds_its_special_tokens(make_sim, make_proxy,
                                                                                   hf_tokenizer):
    proxy = await make_proxy(await make_sim())
    assert proxy.app[CONNECTION].connected is not None
    text, ids = tokenizer_check.encode_probe(hf_tokenizer)
    assert text.startswith(tokenizer_check.PROBE)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"):
        assert hf_tokenizer.convert_tokens_to_ids(special) in ids
    resp = await proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2})
    assert resp.status == 200


async def test_a_changed_tokenizer_after_an_outage_stops_the_proxy(make_sim, aiohttp_client, shared_tokenizer,
                                                                   tokenizer_dir, other_tokenizer_dir):
    """SGLang came back (the /metrics reader saw the outage end) on another model's tokenizer."""
    from tokenizers import Tokenizer

    sim = await make_sim()
    _, conn, fatal = await proxy_app(aiohttp_client, sim, tokenizer=str(tokenizer_dir), backend_metrics_interval_s=0)
    assert conn.connected is not None
    conn.outage_began("connection refused")
    conn.outage_ended()  # the same tokenizer: nothing happens
    await asyncio.sleep(0.5)
    assert conn.connected is not None and fatal == []
    sim.app[SIM_STATE].tokenizer = Tokenizer.from_file(str(other_tokenizer_dir / "tokenizer.json"))
    conn.outage_began("connection refused")
    conn.outage_ended()
    for _ in range(100):
        if fatal:
            break
        await asyncio.sleep(0.05)
    assert len(fatal) == 1 and fatal[0].startswith(f"after SGLang came back: the proxy's tokenizer '{tokenizer_dir}'")
    assert conn.connected is None


class NoTokenize:
    """An SGLang that cannot tokenize (no /v1/tokenize, or --skip-tokenizer-init)."""

    base_url = "http://sglang:30000"

    async def call(self, method, path, body, timeout_s):
        assert (method, path, orjson.loads(body)["add_special_tokens"]) == ("POST", "/v1/tokenize", False)
        return 404, b'{"detail":"Not Found"}', "application/json"


async def test_an_sglang_that_cannot_tokenize_is_compared_by_path_with_a_warning(hf_tokenizer, caplog):
    async def run(fn, *args):
        return fn(*args)

    caplog.set_level(logging.WARNING, "token_proxy.sglang.config_checks")
    assert await tokenizer_check.compare(NoTokenize(), hf_tokenizer, "/models/a", "/models/b", run) is None
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        ("SGLang at http://sglang:30000 does not tokenize (POST /v1/tokenize: HTTP 404): the proxy's tokenizer is "
         "compared with SGLang's by /model_info's tokenizer_path only"),
        ("the proxy's tokenizer '/models/a' is not the path SGLang loaded ('/models/b'): make sure they are the same "
         "tokenizer")]


def test_the_cli_exits_2_in_one_line_naming_both_tokenizers(other_tokenizer_dir):
    """The user's path: SGLang (the simulator, on its built-in Qwen2 tokenizer) and `token-proxy --tokenizer`."""
    sim_port, port = free_port(), free_port()
    sim = subprocess.Popen([sys.executable, "-m", "token_proxy.simulator", "--port", str(sim_port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while http_status(sim_port, "/health") != 200:
            assert time.monotonic() < deadline and sim.poll() is None, "the simulator did not start"
            time.sleep(0.1)
        proc = subprocess.run([sys.executable, "-m", "token_proxy", "--backend", f"http://127.0.0.1:{sim_port}",
                               "--tokenizer", str(other_tokenizer_dir), "--host", "127.0.0.1", "--port", str(port),
                               "--log-format", "json"], capture_output=True, text=True, timeout=120, check=False)
    finally:
        sim.terminate()
        sim.wait(10)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line["message"] for line in map(json.loads, proc.stderr.splitlines()) if line["level"] == "error"]
    assert errors and errors[0].startswith(f"the proxy's tokenizer '{other_tokenizer_dir}' (301 tokens")
    assert "--allow-tokenizer-mismatch" in errors[0]
