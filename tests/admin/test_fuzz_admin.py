"""An admin fuzz (issue 41.1, 41.4): random admin calls of every dialect, in random order and with random bodies,
while chats and native /generate calls run, through the proxy to a simulator with --enable-memory-saver (whose
crash model is SGLang's: a release while busy, a resume of what is not released, a bad /generate). After every
call SGLang must be healthy and the answer must not be a 500. A kill is counted, the simulator brought back (as
a restart would) and the fuzz goes on, so one run reports every kill.

By default 150 calls (seconds); TOKEN_PROXY_ADMIN_FUZZ_N=1500 runs the issue's 1,500. On d6350dc the same
seed killed the simulator (the forwarded memory calls) and answered 500s (bad admin bodies)."""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter

import aiohttp

from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.rl_routes import _come_back

CALLS = int(os.environ.get("TOKEN_PROXY_ADMIN_FUZZ_N", "150"))
SEED = 41
TRAFFIC_TIMEOUT_S = 1.0
FOX = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
TAGS = [None, [], ["kv_cache"], ["weights"], ["cuda_graph"], ["kv_cache", "cuda_graph"], ["weights", "kv_cache"],
        "kv_cache", ["bogus"], [1], {"a": 1}]
ODD = [None, "", "x", 1, -1, 1.5, True, [], ["x"], {}, {"k": "v"}, "a" * 300, "/tmp", "/" + "a" * 5000]


def admin_call(rng: random.Random) -> tuple[str, str, dict | None, dict | None]:
    """(method, path, query, body)."""
    odd = rng.choice(ODD)
    calls = [
        ("POST", "/release_memory_occupation", None, {"tags": rng.choice(TAGS)}),
        ("POST", "/resume_memory_occupation", None, {"tags": rng.choice(TAGS)}),
        ("POST", "/release_memory_occupation", None, {}),
        ("POST", "/resume_memory_occupation", None, {}),
        ("POST", "/sleep", {"level": rng.choice(["0", "1", "2", "3", "x"]),
                            "mode": rng.choice(["abort", "wait", "keep"])}, None),
        ("POST", "/wake_up", rng.choice([None, {"tags": "weights"}, {"tags": "kv_cache"}, {"tags": "x"}]), None),
        ("POST", "/release_kv_cache_memory", None, None),
        ("POST", "/pause", rng.choice([None, {"mode": "abort"}, {"mode": "wait"}, {"mode": "keep"}]), None),
        ("POST", "/pause", None, {"mode": rng.choice(["abort", "keep", "in_place", odd])}),
        ("POST", "/resume", rng.choice([None, {"force": "true"}]), None),
        ("POST", "/pause_generation", None, {"mode": rng.choice(["abort", "in_place", "retract", odd])}),
        ("POST", "/continue_generation", None, {}),
        ("POST", "/flush_cache", None, None),
        ("POST", "/reset_prefix_cache", None, None),
        ("POST", "/update_weight_version", None, {"new_version": rng.choice(["v1", "v2", odd])}),
        ("POST", "/destroy_weights_update_group", None, {"group_name": rng.choice(["weight_update_group", odd])}),
        ("POST", "/update_weights", None, {"weight_dir": odd}),
        ("POST", "/update_weights_from_disk", None, {"model_path": odd}),
        ("POST", "/start_weight_update", None, None),
        ("POST", "/finish_weight_update", None, rng.choice([None, {"weight_version": rng.choice(["3", odd])}])),
        ("POST", "/abort_requests", None, rng.choice([{}, {"request_ids": odd}])),
        ("POST", "/get_weights_by_name", None, {"name": rng.choice(["model.norm.weight", odd])}),
        ("GET", "/is_sleeping", None, None),
        ("GET", "/weight_info", None, None),
        ("POST", "/v1/load_lora_adapter", None, {"lora_name": odd, "lora_path": odd}),
        ("POST", "/unload_lora_adapter", None, {"lora_name": odd}),
    ]
    return rng.choice(calls)


async def traffic(proxy, stop: asyncio.Event, rng: random.Random) -> Counter:
    """Chats and native /generate, one after another, until stopped (their statuses are counted apart)."""
    seen: Counter = Counter()
    while not stop.is_set():
        if rng.random() < 0.5:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Count."}],
                                                  "max_tokens": rng.randint(1, 12), "ignore_eos": True}
        else:
            path, body = "/generate", {"input_ids": FOX, "stream": rng.random() < 0.5,
                                       "sampling_params": {"max_new_tokens": rng.randint(1, 12)}}
        try:  # a paused fleet holds it: the client gives up, as a trainer's timeout would
            async with asyncio.timeout(TRAFFIC_TIMEOUT_S):
                response = await proxy.post(path, json=body)
                await response.read()
            seen[response.status] += 1
        except TimeoutError:
            seen["gave up"] += 1
    return seen


async def test_admin_fuzz_kills_sglang_zero_times(make_sim, make_proxy, fake_group):
    sim = await make_sim(enable_memory_saver=True, enable_weights_cpu_backup=True, tpot_s=0.01)
    proxy = await make_proxy(sim, admin_timeout_s=1.0, weight_update_timeout_s=2.0)
    rng = random.Random(SEED)
    stop = asyncio.Event()
    background = [asyncio.create_task(traffic(proxy, stop, random.Random(SEED + i))) for i in range(2)]
    statuses: Counter = Counter()
    kills, five_hundreds = [], []
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(CALLS):
                method, path, query, body = admin_call(rng)
                response = await asyncio.wait_for(proxy.request(method, path, params=query, json=body), 30)
                text = await response.text()
                statuses[response.status] += 1
                if response.status == 500:
                    five_hundreds.append((i, path, query, body, text[:200]))
                async with session.get(sim.make_url("/health")) as health:
                    alive = health.status == 200 and not sim.app[SIM_STATE].crashed
                if not alive:
                    kills.append((i, method, path, query, body, response.status))
                    await _come_back(sim.app, 0)
    finally:
        stop.set()
        data = [await task for task in background]
    print(f"\nadmin fuzz: {CALLS} calls, statuses {dict(sorted(statuses.items()))}, kills {len(kills)}, "
          f"data path {dict(sum(data, Counter()))}")
    assert kills == []
    assert five_hundreds == []
    assert statuses[200] > CALLS // 5 and statuses[409] > 0 and statuses[400] > 0
