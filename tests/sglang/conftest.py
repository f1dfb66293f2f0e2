"""An SGLang simulator served over TLS, with a certificate of a CA made for the test (trustme): the proxy
trusts it through SSL_CERT_FILE, as an operator would add a private CA to the system's trust store."""

from __future__ import annotations

import ssl

import pytest


@pytest.fixture
def make_tls_sim(aiohttp_server, tokenizer_dir, tmp_path, monkeypatch):
    """`sim = await make_tls_sim(**SimConfig overrides)`: https://127.0.0.1:<port>, trusted by clients made
    after the call (SGLangClient's default context reads SSL_CERT_FILE)."""
    trustme = pytest.importorskip("trustme")
    from token_proxy.simulator import SimConfig, create_sim_app

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(server_ctx)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))

    async def factory(**overrides):
        overrides.setdefault("enable_deterministic_inference", True)
        config = SimConfig(tokenizer_path=str(tokenizer_dir), **overrides)
        return await aiohttp_server(create_sim_app(config), ssl=server_ctx)

    return factory
