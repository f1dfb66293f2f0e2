"""Fuzzing SGLang's native routes through the proxy's pass-through, over the simulator.

Random and malformed /generate bodies (ids of every type and size, batches, random sampling_params
keys and values, logprob fields) and bodies for the other pass-through routes: never a 5xx, and the
simulator (a stand-in that dies where a real server dies) healthy after every request. Bounded so the
file runs in a few seconds. `pytest -s` prints the statuses seen.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from token_proxy.sglang.sampling import KIND_OF
from token_proxy.simulator import SIM_STATE

FOX = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
TIMEOUT_S = 10.0
FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))

IDS = st.one_of(st.integers(0, 151_000), st.integers(-(2**70), 2**70), st.sampled_from([151_664, 151_665,
                                                                                        151_936, 999_999_999]))
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**66), 2**66), st.floats(allow_nan=True),
                   st.text(max_size=8), st.sampled_from([0, 1, -1, 0.0, 1e308, "", []]))
JSON = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                    max_leaves=6)
ID_LISTS = st.one_of(st.lists(IDS, max_size=6), st.lists(st.lists(IDS, max_size=4), max_size=3),
                     st.lists(st.one_of(IDS, SCALAR), max_size=4), JSON)
SAMPLING = st.dictionaries(st.one_of(st.sampled_from(sorted(KIND_OF)), st.text(max_size=6)),
                           st.one_of(SCALAR, st.lists(st.one_of(IDS, SCALAR), max_size=3), JSON), max_size=4)
SMALL = {"max_new_tokens": 2}
GENERATE = st.fixed_dictionaries(
    {"input_ids": st.one_of(st.just(FOX), ID_LISTS)},
    optional={
        "sampling_params": st.one_of(st.just(SMALL), SAMPLING.map(lambda p: {**SMALL, **p}),
                                     st.lists(SAMPLING.map(lambda p: {**SMALL, **p}), max_size=3), JSON),
        "text": st.one_of(st.text(max_size=10), st.lists(st.text(max_size=5), max_size=3), JSON),
        "stream": st.one_of(st.booleans(), SCALAR),
        "rid": st.one_of(st.text(max_size=6), st.lists(st.text(max_size=4), max_size=3), SCALAR),
        "return_logprob": st.one_of(st.booleans(), SCALAR),
        "top_logprobs_num": st.one_of(st.integers(-3, 200_000), SCALAR, st.lists(SCALAR, max_size=2)),
        "token_ids_logprob": ID_LISTS,
        "logprob_start_len": st.one_of(st.integers(-3, 20), SCALAR),
    })
OTHER = st.tuples(st.sampled_from(["/encode", "/classify", "/v1/score", "/v1/embeddings", "/vertex_generate",
                                   "/abort_request", "/health_generate", "/get_load", "/open_session"]),
                  st.dictionaries(st.sampled_from(["input_ids", "input", "query", "items", "label_token_ids",
                                                   "instances", "parameters", "rid", "abort_all"]),
                                  st.one_of(ID_LISTS, JSON), max_size=3))
RAW = st.one_of(st.binary(max_size=40), st.sampled_from([b"", b"[]", b"null", b"{", b'{"input_ids": [NaN]}',
                                                        b'{"input_ids": [1e400]}', b'{"input_ids": [1, 2]}x']))


async def test_native_routes_never_5xx_and_sglang_stays_up(proxy, sim):
    loop = asyncio.get_running_loop()
    statuses: Counter = Counter()
    health_url = sim.make_url("/health")

    async def send(path: str, raw: bytes) -> int:
        response = await asyncio.wait_for(proxy.post(path, data=raw, headers={"Content-Type": "application/json"}),
                                          TIMEOUT_S)
        await response.read()
        async with aiohttp.ClientSession() as session, session.get(health_url) as health:
            assert health.status == 200, f"the simulator is down after {path} {raw[:300]!r}"
        return response.status

    def post(path: str, raw: bytes) -> None:
        status = asyncio.run_coroutine_threadsafe(send(path, raw), loop).result(TIMEOUT_S + 5)
        note(f"{path} {raw[:300]!r} -> {status}")
        statuses[status] += 1
        assert status < 500, f"{path} {raw[:300]!r} -> {status}"

    @FUZZ
    @given(st.one_of(GENERATE.map(lambda body: ("/generate", body)), OTHER))
    def fuzz_json(case):
        path, body = case
        post(path, json.dumps(body).encode())  # json: NaN, Infinity and ints past 64 bits, as a client may

    @settings(FUZZ, max_examples=30)
    @given(RAW)
    def fuzz_raw(raw):
        post("/generate", raw)

    await asyncio.to_thread(fuzz_json)
    await asyncio.to_thread(fuzz_raw)
    print(f"\nnative fuzz statuses: {dict(sorted(statuses.items()))}")
    assert sim.app[SIM_STATE].crashed is False
    assert (await proxy.get("/health")).status == 200
    assert statuses[200] > 0 and statuses[400] > 0  # both kinds of body were sent
