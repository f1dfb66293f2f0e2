"""No 500 for a client's mistake or a worker's restart (issue 41.4): admin bodies are checked before anything
goes upstream, a path too long for the file system is a 400 naming its field, and a worker that is restarting
is a 503 with Retry-After. Each answered 500 on d6350dc."""

from __future__ import annotations

import pytest
from aiohttp import web

from tests.support.lora_fixtures import write_adapter
from token_proxy.simulator import SimConfig, create_sim_app


@pytest.fixture
def recorded(aiohttp_server, tokenizer_dir, make_proxy):
    """A proxy over a simulator that records every path it is sent."""
    async def factory(**proxy_settings):
        seen: list[str] = []

        @web.middleware
        async def record(request, handler):
            seen.append(request.path)
            return await handler(request)

        app = create_sim_app(SimConfig(tokenizer_path=str(tokenizer_dir)))
        app.middlewares.insert(0, record)
        sim = await aiohttp_server(app)
        # No /metrics scrape: every 2 s it would reach `seen`, and a slow one (a loaded box) makes the proxy
        # compare SGLang's config again (/v1/tokenize, ...) when it answers: not the test's request either.
        proxy = await make_proxy(sim, **{"backend_metrics_interval_s": 0.0, **proxy_settings})
        seen.clear()
        return proxy, sim, seen

    return factory


def upstream(seen: list[str]) -> list[str]:
    """The paths SGLang was sent, less the router probe discovery sends on its own (/workers)."""
    return [path for path in seen if path != "/workers"]


async def error_of(response) -> tuple[int, str, str | None]:
    body = await response.json()
    return response.status, body["error"]["message"], body["error"].get("param")


@pytest.mark.parametrize("name", [["x"], {"a": 1}, 7, ""])
async def test_a_bad_group_name_is_a_400_before_sglang_sees_it(recorded, name):
    proxy, _, seen = await recorded()
    status, message, param = await error_of(await proxy.post("/destroy_weights_update_group",
                                                             json={"group_name": name}))
    assert (status, message, param) == (400, f"group_name must be a non-empty string, got {name!r}", "group_name")
    assert upstream(seen) == []
    response = await proxy.post("/destroy_weights_update_group", json={"group_name": "weight_update_group"})
    assert response.status == 400  # SGLang's own answer: no such group (it got this one)
    assert upstream(seen) == ["/destroy_weights_update_group"]


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/update_weights", "weight_dir", "a" * 300),
    ("/update_weights", "weight_dir", "/ckpt/" + "a" * 256 + "/step_3"),
    ("/update_weights", "weight_dir", "/" + "abc/" * 1100),
    ("/update_weights_from_disk", "model_path", "a" * 300),
    ("/v1/load_lora_adapter", "lora_path", "/" + "a" * 300),
])
async def test_a_path_too_long_for_the_file_system_is_a_400(recorded, path, field, value):
    proxy, _, seen = await recorded(check_local_paths=True)
    body = {field: value, "lora_name": "x"} if "lora" in path else {field: value}
    status, message, param = await error_of(await proxy.post(path, json=body))
    assert (status, param) == (400, field)
    assert message.startswith(f"{field} is not a usable path: at most 4095 bytes, each name at most 255 bytes")
    assert upstream(seen) == []


async def test_loading_an_adapter_while_the_worker_restarts_is_a_503_with_retry_after(make_sim, make_proxy,
                                                                                      tmp_path):
    sim = await make_sim()
    proxy = await make_proxy(sim)
    adapter = write_adapter(tmp_path, "step_1")
    await proxy.post("/sim/restart", json={"restart_s": 3.0})  # the pass-through reaches the simulator's route
    response = await proxy.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(adapter)})
    body = await response.json()
    assert response.status == 503, body
    assert response.headers["Retry-After"].isdigit()
    assert body["error"]["type"] != "InternalServerError"


@pytest.mark.parametrize(("body", "message", "param"), [
    ({"name": ["x"]}, "name must be a non-empty string, got ['x']", "name"),
    ({"name": {"a": 1}}, "name must be a non-empty string, got {'a': 1}", "name"),
    ({"name": "model.norm.weight", "truncate_size": "10"}, "truncate_size must be an integer >= 0, got '10'",
     "truncate_size"),
])
async def test_a_bad_weight_read_is_a_400_before_sglang_sees_it(recorded, body, message, param):
    """The admin fuzz's 1,500 calls found these: a 500 from SGLang's stand-in (an unhashable name)."""
    proxy, _, seen = await recorded()
    assert await error_of(await proxy.post("/get_weights_by_name", json=body)) == (400, message, param)
    assert upstream(seen) == []
