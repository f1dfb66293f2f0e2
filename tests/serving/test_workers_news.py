"""`--workers 2`: what the admin owner tells every serving process (serving/owner_news.py), and the trainers'
own routes (issue 39): SkyRL's /finish_session ends a session whichever process receives it, ART's rename
and SkyRL's LoRA load are what every process serves once answered. Every request opens a fresh connection,
so the kernel's SO_REUSEPORT hash spreads them over the processes (tests/serving/test_workers.py's way).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import pytest

from tests.serving.test_workers import USER, Proxy, call, stop, wait_until_serving
from tests.support.admin_fixtures import free_port
from tests.support.lora_fixtures import write_adapter

SPREAD = 16  # requests per check: all on one of 2 processes has odds 2 x 2^-16


@pytest.fixture(scope="module")
def proxy(tokenizer_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("workers_news") / "stderr.log"
    with open(log, "ab") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "token_proxy", "--workers", "2", "--host", "127.0.0.1",
                                 "--port", str(port), "--tokenizer", str(tokenizer_dir), "--log-format", "json",
                                 "--shutdown-timeout", "5"], stdout=sink, stderr=sink)
    server = Proxy(proc, f"http://127.0.0.1:{port}", log)
    wait_until_serving(proc, server, log)
    yield server
    stop(proc)


async def turn(proxy: Proxy, key: str, messages: list[dict]) -> tuple[str, dict]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
            session.post(proxy.url + "/v1/chat/completions", headers={"X-Session-ID": key},
                         json={"messages": messages, "max_tokens": 3, "ignore_eos": True}) as resp:
        reply = await resp.json()
        assert resp.status == 200, reply
        return resp.headers["X-Session-Continuity"], reply


async def test_finish_session_ends_it_whichever_process_receives_it(proxy):
    """issue 39: 13 of 20 finishes on a new connection answered `"finished": false`, and the next turn was
    still a hit (each process kept, and dropped, only its own sessions)."""
    keys = [f"traj-{n}" for n in range(10)]
    firsts = {key: await turn(proxy, key, USER) for key in keys}
    assert proxy.workers_of(reply["id"] for _, reply in firsts.values()) == {0, 1}
    await asyncio.sleep(0.5)  # each turn is recorded after its reply, off the event loop
    for key in keys:
        assert await call("POST", proxy.url + "/finish_session", params={"session_id": key}) == (
            200, {"session_id": key, "finished": True})
    for key, (_, reply) in firsts.items():
        messages = [*USER, reply["choices"][0]["message"], {"role": "user", "content": "again"}]
        assert (await turn(proxy, key, messages))[0] == "fallback; reason=unknown_session", key
    assert await call("POST", proxy.url + "/finish_session", params={"session_id": "never"}) == (
        200, {"session_id": "never", "finished": False})


async def test_art_rename_is_what_every_process_serves_once_answered(proxy):
    status, models = await call("GET", proxy.url + "/v1/models")
    base = models["data"][0]["id"]
    try:
        for step in (1, 2):
            name = f"{base}@{step}"
            assert await call("POST", proxy.url + "/art/set_served_model_name", json={"name": name}) == (
                200, {"name": name})
            ids = []
            for _ in range(SPREAD // 2):
                status, models = await call("GET", proxy.url + "/v1/models")
                assert [card["id"] for card in models["data"]] == [name]
                status, reply = await call("POST", proxy.url + "/v1/chat/completions",
                                           json={"model": name, "messages": USER, "max_tokens": 2})
                assert (status, reply["model"]) == (200, name)
                ids.append(reply["id"])
                status, reply = await call("POST", proxy.url + "/v1/chat/completions",
                                           json={"model": base, "messages": USER, "max_tokens": 2})
                assert (status, reply["error"]["param"]) == (404, "model")
            assert proxy.workers_of(ids) == {0, 1}
    finally:
        assert (await call("POST", proxy.url + "/art/set_served_model_name", json={"name": base}))[0] == 200


async def test_skyrl_lora_load_is_what_every_process_serves_once_answered(proxy, tmp_path):
    for step in (1, 2):
        status, reply = await call("POST", proxy.url + "/skyrl/v1/load_lora_adapter",
                                   json={"lora_name": "policy", "lora_path": str(write_adapter(tmp_path, f"s{step}"))})
        assert (status, reply) == (200, {"status": "ok", "lora_name": "policy", "lora_int_id": 1})
        ids = []
        for _ in range(SPREAD):
            status, reply = await call("POST", proxy.url + "/v1/chat/completions",
                                       json={"model": "policy", "messages": USER, "max_tokens": 2})
            assert (status, reply["model"]) == (200, "policy")
            ids.append(reply["id"])
        assert proxy.workers_of(ids) == {0, 1}
