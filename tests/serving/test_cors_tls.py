"""vllm serve's CORS and TLS flags (issue 31): off by default; with origins, preflights are answered before
keys and every reply (streams too) carries the headers; with a certificate the port speaks TLS."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys

import aiohttp
import pytest

from tests.support.admin_fixtures import free_port, stop_process

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_cors_is_off_unless_origins_are_given(make_sim, make_proxy):
    proxy = await make_proxy(await make_sim())
    response = await proxy.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://ui.example"})
    assert response.status == 200 and "Access-Control-Allow-Origin" not in response.headers
    preflight = await proxy.options("/v1/chat/completions", headers={
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status == 405


async def test_an_allowed_origin_gets_preflights_and_headers_on_streams_too(make_sim, make_proxy):
    proxy = await make_proxy(await make_sim(), allowed_origins=("https://ui.example",), allow_credentials=True,
                             api_key="k")
    preflight = await proxy.options("/v1/chat/completions", headers={
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status == 200  # before the key check: a browser sends none with a preflight
    assert {k: preflight.headers[k] for k in ("Access-Control-Allow-Origin", "Access-Control-Allow-Credentials",
                                              "Access-Control-Allow-Headers", "Vary")} == {
        "Access-Control-Allow-Origin": "https://ui.example", "Access-Control-Allow-Credentials": "true",
        "Access-Control-Allow-Headers": "authorization, content-type", "Vary": "Origin"}
    auth = {"Origin": "https://ui.example", "Authorization": "Bearer k"}
    whole = await proxy.post("/v1/chat/completions", json=CHAT, headers=auth)
    assert whole.status == 200 and whole.headers["Access-Control-Allow-Origin"] == "https://ui.example"
    stream = await proxy.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth)
    assert stream.headers["Access-Control-Allow-Origin"] == "https://ui.example"
    assert (await stream.read()).endswith(b"data: [DONE]\n\n")
    refused = await proxy.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://ui.example"})
    assert refused.status == 401 and refused.headers["Access-Control-Allow-Origin"] == "https://ui.example"
    other = await proxy.options("/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status == 400 and "Access-Control-Allow-Origin" not in other.headers


def test_tls_flags_fail_at_start_up_in_one_line(tmp_path):
    from token_proxy.serving.tls import server_ssl_context
    from token_proxy.settings import Settings

    assert server_ssl_context(Settings()) is None
    with pytest.raises(ValueError, match="--ssl-keyfile and --ssl-ca-certs need --ssl-certfile"):
        server_ssl_context(Settings(ssl_keyfile="/k.pem"))
    with pytest.raises(ValueError, match="--ssl-certfile '/no/cert.pem': no such file"):
        server_ssl_context(Settings(ssl_certfile="/no/cert.pem"))
    garbage = tmp_path / "cert.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ValueError, match="--ssl-certfile"):
        server_ssl_context(Settings(ssl_certfile=str(garbage)))


async def test_the_port_speaks_tls_with_a_certificate(tmp_path, tokenizer_dir):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "token_proxy", "--host", "127.0.0.1", "--port", str(port),  # noqa: ASYNC220
                             "--tokenizer", str(tokenizer_dir), "--ssl-certfile", str(tmp_path / "server.pem"),
                             "--log-format", "json"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(300):
                try:
                    async with session.get(f"https://127.0.0.1:{port}/health", ssl=client_context) as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                await __import__("asyncio").sleep(0.1)
            async with session.post(f"https://127.0.0.1:{port}/v1/chat/completions", json=CHAT,
                                    ssl=client_context) as response:
                assert response.status == 200 and (await response.json())["object"] == "chat.completion"
            with pytest.raises(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{port}/health") as response:
                    await response.read()
    finally:
        stop_process(proc)
    lines = [json.loads(line) for line in proc.stderr.read().decode().splitlines() if line.startswith("{")]
    assert any(line["message"].startswith(f"token-proxy listening on https://127.0.0.1:{port}/v1") for line in lines)
