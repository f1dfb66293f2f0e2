"""Flags as vLLM users type them, and flag errors that name what to fix (issue 31)."""

from __future__ import annotations

import pytest

from token_proxy import __version__
from token_proxy.cli import known_variables, parse_settings


def error_of(capsys, argv, environ=None) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv, environ or {})
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


def test_an_unknown_token_proxy_variable_is_a_startup_error_naming_the_close_one(capsys):
    line = error_of(capsys, [], {"TOKEN_PROXY_BAKEND": "http://127.0.0.1:30000"})
    assert line == ("token-proxy: error: unknown environment variable TOKEN_PROXY_BAKEND (did you mean "
                    "TOKEN_PROXY_BACKEND?; unset it to start) (see token-proxy --help)")
    line = error_of(capsys, [], {"TOKEN_PROXY_ZZZ": "1"})
    assert "unknown environment variable TOKEN_PROXY_ZZZ (see token-proxy --help for the variables" in line
    # another spelling of a flag reads no variable of its own: the flag's is named
    line = error_of(capsys, [], {"TOKEN_PROXY_MAX_MODEL_LEN": "77"})
    assert "unknown environment variable TOKEN_PROXY_MAX_MODEL_LEN (did you mean TOKEN_PROXY_CONTEXT_LENGTH?" in line


def test_every_flag_and_spelling_has_a_known_variable():
    known = known_variables()
    for name in ("TOKEN_PROXY_BACKEND", "TOKEN_PROXY_CONTEXT_LENGTH", "TOKEN_PROXY_WORKERS",
                 "TOKEN_PROXY_ENABLE_LOG_REQUESTS", "TOKEN_PROXY_ALLOW_UNHONOURED_SEED", "TOKEN_PROXY_GOLDEN_DIR"):
        assert name in known
    assert parse_settings([], {"TOKEN_PROXY_PORT": "9001", "OTHER": "x"}).port == 9001


def test_vllm_serve_spellings_are_accepted():
    settings = parse_settings(["--max-model-len", "2048", "--api-server-count", "3", "--enable-log-requests"], {})
    assert (settings.context_length, settings.api_workers, settings.disable_log_requests) == (2048, 3, False)
    assert parse_settings(["--enable-log-requests", "false"], {}).disable_log_requests is True
    assert parse_settings([], {"TOKEN_PROXY_ENABLE_LOG_REQUESTS": "false"}).disable_log_requests is True


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(["--version"], {})
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"token-proxy {__version__}"
    assert __version__.count(".") >= 2


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    (["--port", "70000"], {}, "--port must be in 0..65535, got 70000"),
    ([], {"TOKEN_PROXY_PORT": "70000"}, "TOKEN_PROXY_PORT (--port) must be in 0..65535, got 70000"),
    ([], {"TOKEN_PROXY_PORT": "abc"}, "TOKEN_PROXY_PORT: invalid int value: 'abc'"),
    (["--log-format", "xml"], {}, "--log-format must be text or json, got 'xml'"),
    ([], {"TOKEN_PROXY_LOG_LEVEL": "loud"}, "TOKEN_PROXY_LOG_LEVEL (--log-level) must be debug, info, warning or error"),
    (["--tool-call-streaming", "halves"], {}, "--tool-call-streaming must be fragments or whole, got 'halves'"),
    (["--backend", "http://[::1:30000"], {}, "--backend 'http://[::1:30000' is not a valid URL (Invalid IPv6 URL)"),
])
def test_flag_errors_name_the_flag_or_the_variable_that_gave_the_value(capsys, argv, environ, expected):
    assert expected in error_of(capsys, argv, environ)


def test_an_https_backend_without_a_port_warns(caplog):
    settings = parse_settings(["--backend", "https://sglang.example"], {})
    assert settings.backend_url == "https://sglang.example"
    assert any("names no port: using port 443" in r.getMessage() for r in caplog.records)


async def test_the_simulator_says_so_in_models_and_version_answers(make_sim, make_proxy):
    sim = await make_sim()
    real, simulated = await make_proxy(sim), await make_proxy(sim, simulator=True)
    assert (await (await real.get("/v1/models")).json())["data"][0]["owned_by"] == "sglang-token-proxy"
    card = (await (await simulated.get("/v1/models")).json())["data"][0]
    assert card["owned_by"] == "sglang-token-proxy-simulator (not a model: start with --backend)"
    response = await real.get("/version")
    assert (response.status, await response.json()) == (200, {"version": __version__})


def test_several_served_model_names_and_api_keys_as_vllm_serve_takes_them():
    settings = parse_settings(["--served-model-name", "policy", "qwen", "--api-key", "k1", "--api-key", "k2"], {})
    assert (settings.served_model_name, settings.served_model_aliases, settings.api_key) == (
        "policy", ("qwen",), ("k1", "k2"))
    settings = parse_settings([], {"TOKEN_PROXY_API_KEY": "a,b", "TOKEN_PROXY_SERVED_MODEL_NAME": "m"})
    assert (settings.served_model_name, settings.served_model_aliases, settings.api_key) == ("m", (), "a,b")


async def test_every_served_name_is_accepted_and_replies_carry_the_first(make_sim, make_proxy):
    sim = await make_sim()
    proxy = await make_proxy(sim, served_model_name="policy", served_model_aliases=("qwen",), api_key=("k1", "k2"))
    for model, key in (("policy", "k1"), ("qwen", "k2"), (None, "k2")):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **({"model": model} if model else {})}
        response = await proxy.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert (response.status, (await response.json())["model"]) == (200, "policy")
    response = await proxy.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                                headers={"Authorization": "Bearer k1"})
    assert response.status == 404
    response = await proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                                headers={"Authorization": "Bearer k3"})
    assert response.status == 401


def test_a_chat_template_flag_reads_its_file_or_takes_the_template(tmp_path):
    from token_proxy.cli import StartupError, read_chat_template

    path = tmp_path / "tpl.jinja"
    path.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert read_chat_template(str(path)) == "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    assert read_chat_template(None) is None
    with pytest.raises(StartupError, match="--chat-template '/no/such.jinja': no such file"):
        read_chat_template("/no/such.jinja")


async def test_the_chat_template_flag_renders_every_chat(make_sim, make_proxy, monkeypatch, tokenizer_dir):
    from transformers import AutoTokenizer

    # A tokenizer of its own: the flag sets its chat template, and the suite's shared one must keep its own.
    own = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    monkeypatch.setattr("token_proxy.sglang.discovery.load_tokenizer", lambda path: own)
    sim = await make_sim()
    proxy = await make_proxy(sim, chat_template="{% for m in messages %}<<{{ m.content }}>>{% endfor %}")
    response = await proxy.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "return_token_strs": True})
    body = await response.json()
    assert response.status == 200, body
    assert "".join(body["token_strs"]) == "<<hi>>"
