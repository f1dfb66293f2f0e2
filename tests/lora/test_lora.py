"""LoRA adapters through the proxy: both dialects, vLLM's status codes, all-or-nothing fan-out, in-place
reload under load, re-load after a worker restart, and prime-rl's own loader run unmodified."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest
from tenacity import retry, retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential

from tests.support.admin_fixtures import free_port, proxy_url, until
from tests.support.lora_fixtures import greedy, write_adapter
from token_proxy.errors import InvalidRequest, NotFound
from token_proxy.lora import ADAPTERS, LORA, AdapterRegistry
from token_proxy.lora.registry import Adapter
from token_proxy.lora.routes import adapter_cards
from token_proxy.sglang.payload import SGLangRequest
from token_proxy.sglang.replies import is_lost_adapter
from token_proxy.sglang.retry_rules import Call, retrying
from token_proxy.simulator import SIM_STATE, SimConfig, start_simulator
from token_proxy.state import CONTEXT

BASE = "sim/qwen2-tiny"


def sim_adapters(server) -> dict[str, str]:
    return dict(server.app[SIM_STATE].lora.loaded)


async def output_ids(sim_client, lora_path: str | None) -> list[int]:
    response = await sim_client.post("/generate", json=greedy(lora_path=lora_path))
    assert response.status == 200, await response.text()
    return (await response.json())["output_ids"]


async def error_of(response) -> tuple[int, str, str]:
    error = (await response.json())["error"]
    return response.status, error["type"], error["message"]


# --- the registry (pure) ------------------------------------------------------------------------------

def test_registry_switches_atomically_and_unloads_the_old_one_after_its_last_request():
    idle = []
    registry = AdapterRegistry(base_names={BASE}, on_idle=idle.append)
    first = Adapter("policy", "/w/step_1", "policy@v1", 1)
    assert registry.switch(first) is None
    assert (registry.resolve(None), registry.resolve(BASE), registry.resolve("policy")) == (None, None, "policy@v1")
    lease = registry.lease("policy")
    second = Adapter("policy", "/w/step_2", "policy@v2", 2)
    assert registry.switch(second) is first and registry.in_use(first) == 1
    assert registry.resolve("policy") == "policy@v2"  # new requests: the new adapter at once
    assert [a.internal for a in registry.held()] == ["policy@v2", "policy@v1"]
    assert lease.lora_path == "policy@v1" and idle == []
    lease.release()
    lease.release()  # idempotent
    assert idle == [first] and [a.internal for a in registry.held()] == ["policy@v2"]
    with registry.lease("policy") as held:
        assert held.lora_path == "policy@v2"
    assert registry.lease(BASE) is None
    with pytest.raises(NotFound, match=r"^The model `other` does not exist\.$"):
        registry.resolve("other")
    assert registry.remove("policy") is second
    with pytest.raises(NotFound, match=r"^The lora adapter 'policy' cannot be found\.$"):
        registry.remove("policy")


def test_adapter_cards_are_vllms():
    registry = AdapterRegistry()
    registry.switch(Adapter("policy", "/w/step_1", "policy@v1", 1))
    assert adapter_cards(registry, BASE, 4096, 123) == [{
        "id": "policy", "object": "model", "created": 123, "owned_by": "sglang-token-proxy",
        "root": "/w/step_1", "parent": BASE, "max_model_len": 4096, "permission": []}]


# --- both dialects --------------------------------------------------------------------------------------

async def test_vllm_routes_load_reload_in_place_and_unload(proxy, sim, tmp_path):
    one, two = write_adapter(tmp_path, "step_1"), write_adapter(tmp_path, "step_2")
    response = await proxy.post("/v1/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(one)})
    assert (response.status, await response.text()) == (200, "Success: LoRA adapter 'policy' added successfully.")
    registry = proxy.app[ADAPTERS]
    assert registry.resolve("policy") == "policy@v1" and sim_adapters(sim) == {"policy@v1": str(one)}
    again = await proxy.post("/v1/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(two)})
    already = ("The lora adapter 'policy' has already been loaded. If you want to load the adapter in place, "
               "set 'load_inplace' to True.")
    assert await error_of(again) == (400, "BadRequestError", already)
    response = await proxy.post("/v1/load_lora_adapter",
                                json={"lora_name": "policy", "lora_path": str(two), "load_inplace": True})
    assert response.status == 200 and registry.resolve("policy") == "policy@v2"
    await until(lambda: sim_adapters(sim) == {"policy@v2": str(two)})  # the old one, unloaded
    response = await proxy.post("/v1/unload_lora_adapter", json={"lora_name": "policy"})
    assert (response.status, await response.text()) == (200, "Success: LoRA adapter 'policy' removed successfully.")
    await until(lambda: sim_adapters(sim) == {})
    again = await proxy.post("/v1/unload_lora_adapter", json={"lora_name": "policy"})
    assert await error_of(again) == (404, "NotFoundError", "The lora adapter 'policy' cannot be found.")
    with pytest.raises(NotFound):
        registry.resolve("policy")


async def test_prime_rl_and_sglang_routes_share_the_registry(proxy, sim, tmp_path):
    for step in (1, 2):  # prime-rl: same name, a new step directory, no load_inplace
        path = write_adapter(tmp_path, f"step_{step}")
        response = await proxy.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(path)})
        assert (response.status, await response.json()) == (200, {
            "status": "ok", "success": True, "error_message": None, "loaded_adapters": {"policy": str(path)}})
    assert proxy.app[ADAPTERS].resolve("policy") == "policy@v2"
    response = await proxy.post("/unload_lora_adapter", json={"lora_name": "policy"})
    assert (response.status, await response.json()) == (200, {
        "success": True, "error_message": "", "loaded_adapters": {}})
    await until(lambda: sim_adapters(sim) == {})


# --- status codes ------------------------------------------------------------------------------------------

async def test_files_not_there_yet_are_vllms_404(proxy, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (tmp_path / "nowhere", empty, write_adapter(tmp_path, "no_weights", weights=False)):
        response = await proxy.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)})
        assert await error_of(response) == (404, "NotFoundError", f"Loading lora x failed: No adapter found for {path}")


@pytest.mark.parametrize("config,words", [
    ("{not json", "adapter_config.json is not valid JSON"),
    ('{"r": 0, "target_modules": ["q_proj"]}', "LoRA rank `r` must be a positive integer, got 0."),
    ('{"r": 16, "target_modules": ["q_proj"]}', "LoRA rank 16 is greater than max_lora_rank 8 (SGLang at "),
    ('{"r": 8, "target_modules": ["q_proj", "down_proj"]}',
     "target modules ['down_proj'] are not in SGLang's --lora-target-modules ['o_proj', 'qkv_proj']"),
])
async def test_an_adapter_sglang_cannot_serve_is_a_400_naming_why(make_sim, make_proxy, tmp_path, config, words):
    sim = await make_sim(max_lora_rank=8, lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    proxy = await make_proxy(sim)
    path = write_adapter(tmp_path)
    (path / "adapter_config.json").write_text(config)
    response = await proxy.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)})
    status, kind, message = await error_of(response)
    assert (status, kind) == (400, "BadRequestError") and words in message, message
    assert sim_adapters(sim) == {}


async def test_request_errors_are_400s_naming_the_field(proxy):
    base = await proxy.post("/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": "/x"})
    assert await error_of(base) == (400, "BadRequestError", f"The lora adapter '{BASE}' conflicts with a served base model.")
    for body in ({"lora_name": "x"}, {"lora_path": "/x"}):
        response = await proxy.post("/v1/load_lora_adapter", json=body)
        assert await error_of(response) == (400, "BadRequestError", "Both 'lora_name' and 'lora_path' must be provided.")
    response = await proxy.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x", "load_inplace": 1})
    assert (await response.json())["error"]["param"] == "load_inplace"
    response = await proxy.post("/v1/unload_lora_adapter", json={})
    assert await error_of(response) == (400, "BadRequestError",
                                        "'lora_name' needs to be provided to unload a LoRA adapter.")


async def test_sglangs_own_refusal_passes_through_when_the_proxy_cannot_check(make_sim, make_proxy, tmp_path):
    sim = await make_sim(max_lora_rank=4)
    proxy = await make_proxy(sim, check_local_paths=False)
    response = await proxy.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(write_adapter(tmp_path))})
    status, _, message = await error_of(response)
    assert status == 400 and "LoRA adapter x@v1 with rank 8 is incompatible" in message
    response = await proxy.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "late")})
    assert (await error_of(response))[0] == 404  # SGLang looked it up as a Hub id: not there (yet)


# --- fan-out -----------------------------------------------------------------------------------------------

async def test_a_load_is_all_or_nothing_and_names_the_failed_worker(make_sim, make_proxy, tmp_path):
    good, small = await make_sim(), await make_sim(max_lora_rank=4)
    urls = [str(s.make_url("")).rstrip("/") for s in (good, small)]
    proxy = await make_proxy(good, workers=tuple(urls), check_local_paths=False)
    path = str(write_adapter(tmp_path))
    response = await proxy.post("/v1/load_lora_adapter", json={"lora_name": "policy", "lora_path": path})
    status, _, message = await error_of(response)
    assert status == 400 and message.startswith(f"load_lora_adapter policy failed on 1 of 2 worker(s): {urls[1]}: 400 ")
    assert sim_adapters(good) == {} and sim_adapters(small) == {}  # taken back where it had loaded
    assert proxy.app[ADAPTERS].adapters() == []

    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await make_proxy(good, workers=(urls[0], dead), admin_timeout_s=5.0)
    response = await proxy.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": path})
    status, kind, message = await error_of(response)
    assert (status, kind) == (500, "InternalServerError") and f"{dead}: unreachable" in message  # prime-rl retries
    assert sim_adapters(good) == {}


async def test_a_load_reaches_every_worker(make_sim, make_proxy, tmp_path):
    sims = [await make_sim(), await make_sim()]
    urls = tuple(str(s.make_url("")).rstrip("/") for s in sims)
    proxy = await make_proxy(sims[0], workers=urls)
    path = str(write_adapter(tmp_path))
    assert (await proxy.post("/load_lora_adapter", json={"lora_name": "p", "lora_path": path})).status == 200
    assert [sim_adapters(s) for s in sims] == [{"p@v1": path}] * 2


# --- in-place reload under load ---------------------------------------------------------------------------

async def test_in_place_reload_under_concurrent_load_fails_no_request(make_sim, make_proxy, aiohttp_client, tmp_path):
    """Requests lease the adapter they resolved and finish on it while new steps load; every output is the
    one its step's weights give, and each replaced step is unloaded once its last request ended."""
    sim = await make_sim(tpot_s=0.002)
    proxy = await make_proxy(sim)
    sim_client = await aiohttp_client(sim)
    registry = proxy.app[ADAPTERS]
    paths = [write_adapter(tmp_path, f"step_{i}") for i in range(1, 5)]
    await proxy.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(paths[0])})
    results: list[tuple[str, list[int]]] = []

    async def rollout() -> None:
        with registry.lease("policy") as lease:
            results.append((lease.adapter.path, await output_ids(sim_client, lease.lora_path)))

    async def trainer() -> None:
        for path in paths[1:]:
            await asyncio.sleep(0.03)
            response = await proxy.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(path)})
            assert response.status == 200

    await asyncio.gather(trainer(), *(rollout() for _ in range(40)))
    for _ in range(40):  # and after the last step
        await rollout()
    assert len(results) == 80 and {path for path, _ in results} >= {str(paths[0]), str(paths[-1])}
    expected = {str(p): ids for p, ids in results}  # one output per step, as greedy sampling must
    assert all(ids == expected[path] for path, ids in results) and len(set(map(tuple, expected.values()))) == len(expected)
    await until(lambda: sim_adapters(sim) == {"policy@v4": str(paths[-1])})


# --- restarts ---------------------------------------------------------------------------------------------

async def test_a_restarted_worker_gets_its_adapters_back(make_proxy, aiohttp_client, tokenizer_dir, tmp_path,
                                                        monkeypatch):
    config, port = SimConfig(tokenizer_path=str(tokenizer_dir)), free_port()
    runner, _ = await start_simulator(config, port=port)
    url = f"http://127.0.0.1:{port}"
    proxy = await make_proxy(url, lora_sync_interval_s=0.05)
    path = str(write_adapter(tmp_path))
    assert (await proxy.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": path})).status == 200
    async with httpx.AsyncClient(base_url=url) as client:
        before = (await client.post("/generate", json=greedy(lora_path="policy@v1"))).json()["output_ids"]
        await runner.cleanup()  # the worker restarts, empty
        runner, _ = await start_simulator(config, port=port)
        try:
            lost = await client.post("/generate", json=greedy(lora_path="policy@v1"))
            if lost.status_code == 400:  # the proxy's sync loop may already have put it back
                assert is_lost_adapter(lost.json()["error"]["message"])
            state = runner.app[SIM_STATE]
            await until(lambda: state.lora.loaded == {"policy@v1": path}, timeout=10)
            after = (await client.post("/generate", json=greedy(lora_path="policy@v1"))).json()["output_ids"]
            assert after == before
            assert await proxy.app[LORA].sync_workers() == 0  # nothing left to do
        finally:
            await runner.cleanup()


async def test_a_request_refused_for_a_lost_adapter_is_retried_after_a_reload(make_proxy, tokenizer_dir, tmp_path,
                                                                             monkeypatch):
    config, port = SimConfig(tokenizer_path=str(tokenizer_dir)), free_port()
    runner, _ = await start_simulator(config, port=port)
    proxy = await make_proxy(f"http://127.0.0.1:{port}", lora_sync_interval_s=0)  # no pass: the retry does it
    await proxy.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(write_adapter(tmp_path))})
    await runner.cleanup()
    runner, _ = await start_simulator(config, port=port)
    try:
        client = proxy.app[CONTEXT].client  # the data path's own client, as the pipeline calls it
        payload = greedy(lora_path=proxy.app[ADAPTERS].resolve("policy"))
        payload["sampling_params"]["ignore_eos"] = True  # greedy ids depend on the adapter's path: EOS may come early
        with pytest.raises(InvalidRequest) as refused:
            await client.generate(SGLangRequest(payload, []))
        assert is_lost_adapter(refused.value.message)
        # the pipeline's call: the adapter re-loaded, sent again
        reply = await client.generate(SGLangRequest(payload, [], reload=proxy.app[LORA]))
        assert len(reply[0]["output_ids"]) == 8
    finally:
        await runner.cleanup()


async def test_metrics_list_adapters_with_their_version(proxy, tmp_path):
    path = str(write_adapter(tmp_path))
    await proxy.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": path})
    text = await (await proxy.get("/metrics")).text()
    assert (f'token_proxy_lora_adapter_loaded_timestamp_seconds{{adapter="policy",internal="policy@v1",'
            f'path="{path}",version="1"}}') in text
    assert 'token_proxy_lora_adapter_requests_in_flight{adapter="policy",version="1"} 0.0' in text


async def test_lora_modules_load_once_sglang_is_up(sim, make_proxy, tmp_path):
    path = str(write_adapter(tmp_path))
    proxy = await make_proxy(sim, lora_modules=(("sql", path),))
    await until(lambda: proxy.app[ADAPTERS].get("sql") is not None)
    assert sim_adapters(sim) == {"sql@v1": path}


def test_lora_modules_flag_takes_vllms_forms():
    from token_proxy.cli import parse_settings

    settings = parse_settings(["--lora-modules", "a=/w/a", '{"name": "b", "path": "/w/b"}', "--lora-modules", "c=/w/c"],
                              environ={})
    assert settings.lora_modules == (("a", "/w/a"), ("b", "/w/b"), ("c", "/w/c"))
    assert parse_settings([], environ={"TOKEN_PROXY_LORA_MODULES": "a=/w/a,b=/w/b"}).lora_modules == (
        ("a", "/w/a"), ("b", "/w/b"))
    with pytest.raises(SystemExit):
        parse_settings(["--lora-modules", "no-path"], environ={})


# --- prime-rl, unmodified -----------------------------------------------------------------------------------
# Copied verbatim from PrimeIntellect-ai/prime-rl src/prime_rl/utils/client.py (commit 559b447):
# _is_retryable_lora_error, LORA_LOAD_*_TIMEOUT_S, load_lora_adapter, unload_lora_adapter. The only
# change: get_logger() is prime-rl's loguru wrapper; logging.getLogger stands in for it.

def get_logger():
    return logging.getLogger("prime_rl")


def _is_retryable_lora_error(exception: BaseException) -> bool:
    """Check if an exception should trigger a retry for LoRA loading."""
    if isinstance(exception, httpx.HTTPStatusError):
        # Retry on 404 (adapter not found) or 500 (server error during loading)
        return exception.response.status_code in (404, 500)
    # Retry on transport-level failures (timeouts, connection resets, etc.) so
    # the per-call read timeout below turns a stuck server into a bounded retry
    # loop instead of propagating as a hard failure on the first hiccup.
    if isinstance(exception, (httpx.TimeoutException, httpx.TransportError)):  # noqa: SIM103 (verbatim)
        return True
    return False


LORA_LOAD_READ_TIMEOUT_S = 30.0
LORA_LOAD_TOTAL_TIMEOUT_S = 120.0


async def load_lora_adapter(admin_clients: list[httpx.AsyncClient], lora_name: str, lora_path: Path) -> None:
    logger = get_logger()
    lora_path_posix = lora_path.as_posix()

    @retry(
        retry=retry_if_exception(_is_retryable_lora_error),
        stop=stop_after_delay(LORA_LOAD_TOTAL_TIMEOUT_S) | stop_after_attempt(10),
        wait=wait_exponential(multiplier=1, min=1, max=10),
        reraise=True,
    )
    async def _load_lora_adapter(admin_client: httpx.AsyncClient) -> None:
        logger.debug(f"Sending request to load LoRA adapter {lora_name} from {lora_path}")
        response = await admin_client.post(
            "/load_lora_adapter",
            json={"lora_name": lora_name, "lora_path": lora_path_posix},
            timeout=httpx.Timeout(connect=10.0, read=LORA_LOAD_READ_TIMEOUT_S, write=60.0, pool=10.0),
        )
        response.raise_for_status()

    await asyncio.gather(*[_load_lora_adapter(admin_client) for admin_client in admin_clients])


async def unload_lora_adapter(admin_clients: list[httpx.AsyncClient], lora_name: str) -> None:
    """Make a HTTP post request to the vLLM server to unload a LoRA adapter."""
    logger = get_logger()

    async def _unload_lora_adapter(admin_client: httpx.AsyncClient) -> None:
        logger.debug(f"Sending request to unload LoRA adapter {lora_name}")
        await admin_client.post("/v1/unload_lora_adapter", json={"lora_name": lora_name})
        # TODO: The first one can fail, but subsequent ones should succeed.
        # response.raise_for_status()

    await asyncio.gather(*[_unload_lora_adapter(admin_client) for admin_client in admin_clients])


async def test_prime_rl_loader_retries_until_a_late_step_directory_appears(proxy, sim, tmp_path):
    step = tmp_path / "run" / "broadcasts" / "step_3"

    answers: list[int] = []  # the proxy's answer to each load attempt
    answered = asyncio.Event()

    async def seen(response: httpx.Response) -> None:
        answers.append(response.status_code)
        answered.set()

    async def late_write() -> None:  # the trainer's files reach this filesystem after the first attempt
        await answered.wait()
        write_adapter(step.parent, step.name)

    async with httpx.AsyncClient(base_url=proxy_url(proxy), event_hooks={"response": [seen]}) as admin:
        await asyncio.gather(load_lora_adapter([admin], "policy-lora", step), late_write())
        assert answers == [404, 200]  # refused (the directory is not there yet), retried, loaded
        assert proxy.app[ADAPTERS].resolve("policy-lora") == "policy-lora@v1"
        assert sim_adapters(sim) == {"policy-lora@v1": str(step)}
        await load_lora_adapter([admin], "policy-lora", write_adapter(tmp_path, "step_4"))  # next step
        assert proxy.app[ADAPTERS].resolve("policy-lora") == "policy-lora@v2"
        await unload_lora_adapter([admin], "policy-lora")
    await until(lambda: sim_adapters(sim) == {})
    with pytest.raises(NotFound):
        proxy.app[ADAPTERS].resolve("policy-lora")


async def test_background_sync_survives_an_unexpected_error(proxy, monkeypatch):
    admin, passes = proxy.app[LORA], []

    async def flaky():
        passes.append(1)
        if len(passes) == 1:
            raise RuntimeError("a bug in one pass")
        return 0

    monkeypatch.setattr(admin, "sync_workers", flaky)
    loop = asyncio.create_task(admin.sync_forever(0.001))
    try:
        await until(lambda: len(passes) >= 3)
    finally:
        loop.cancel()


async def test_a_sync_pass_unloads_leftovers_and_forgets_them(proxy, sim, aiohttp_client, tmp_path):
    admin, path = proxy.app[LORA], str(write_adapter(tmp_path))
    sim_client = await aiohttp_client(sim)
    loaded = await sim_client.post("/load_lora_adapter", json={"lora_name": "old@v1", "lora_path": path})
    assert loaded.status == 200  # a retired adapter whose unload failed earlier
    admin.garbage.add("old@v1")
    await admin.sync_workers()
    assert sim_adapters(sim) == {} and admin.garbage == set()
    assert await admin.sync_workers() == 0  # nothing left to do


async def test_requests_refused_for_a_lost_adapter_share_one_sync_pass(proxy, monkeypatch):
    admin, passes = proxy.app[LORA], []

    async def one_pass():
        passes.append(1)
        await asyncio.sleep(0.05)
        return 1

    monkeypatch.setattr(admin, "sync_workers", one_pass)

    def sender():
        refused = []

        async def send():
            if not refused:
                refused.append(1)
                raise InvalidRequest("The following requested LoRA adapters are not loaded: policy@v1")
            return "sent"
        return send

    sends = [sender() for _ in range(5)]  # through the client's one retry point, as every SGLang call goes
    assert await asyncio.gather(*(retrying(lambda _again, send=send: send(), Call(reload=admin)) for send in sends)) == \
        ["sent"] * 5
    assert len(passes) == 1
