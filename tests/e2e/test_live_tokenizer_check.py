"""Against a live SGLang (SGLANG_URL; marked gpu by conftest): its /v1/tokenize agrees with the proxy's copy of
its own tokenizer (no false alarm on the real path), another model's tokenizer and a --max-model-len over its
context stop start-up (issue 39 items 2 and 4)."""

from __future__ import annotations

import orjson

from tests.sglang.test_tokenizer_check import build_other_tokenizer
from token_proxy.app import create_app
from token_proxy.settings import Settings
from token_proxy.sglang import config_checks as tokenizer_check
from token_proxy.sglang.discovery import CONNECTION, wait_until_connected


async def test_sglangs_own_tokenizer_passes_the_probe(proxy, sglang, live_tokenizer):
    assert proxy.app[CONNECTION].connected is not None
    text, ours = tokenizer_check.encode_probe(live_tokenizer)
    status, body = await sglang.post("/v1/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200 and body["tokens"] == ours


async def test_another_models_tokenizer_is_fatal(aiohttp_client, sglang_url, tmp_path):
    other = build_other_tokenizer(tmp_path)
    app = create_app(Settings(backend_url=sglang_url, tokenizer=str(other), backend_wait_s=60.0))
    await aiohttp_client(app)
    assert await wait_until_connected(app, 120) is False
    assert app[CONNECTION].fatal.startswith(f"the proxy's tokenizer '{other}' (301 tokens, eos '<|endoftext|>') "
                                            "is not SGLang's (")


async def test_max_model_len_over_sglangs_context_is_fatal(live_proxy, sglang):
    _, models = await sglang.get("/v1/models")
    context = models["data"][0]["max_model_len"]
    proxy = await live_proxy(context_length=2 * context)
    fatal = proxy.app[CONNECTION].fatal
    assert fatal.startswith(f"User-specified max_model_len ({2 * context}) is greater than the context length of SGLang")
    assert fatal.endswith(f"({context}): pass --max-model-len {context} or less, or start SGLang with --context-length "
                          f"{2 * context}")
    resp = await proxy.get("/v1/models")
    assert resp.status == 503 and "User-specified" in orjson.loads(await resp.read())["error"]["message"]
