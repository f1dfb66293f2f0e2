"""The bridge's control process (server.py) without GPUs: its receivers are threads replaying recorded streams
(the same relay loop the real receiver runs; only the IPC payload is replaced by the tensors' names), and SGLang
is a stand-in that records each /update_weights_from_tensor and refuses a named tensor on demand. What this does
not prove: NCCL, CUDA IPC and SGLang's loading (the GPU round does)."""

from __future__ import annotations

import json
import multiprocessing
import struct
import threading

import pytest
from aiohttp import web

from tests.bridge.streams import ReplayChannel, recording
from token_proxy.bridge.receiver import buckets_of, relay, shapes_of
from token_proxy.bridge.server import BridgeSettings, Rank, create_bridge_app


class ThreadProcess:
    def __init__(self, thread):
        self.thread, self.exitcode = thread, None

    def is_alive(self):
        return self.thread.is_alive()

    def join(self, timeout=None):
        self.thread.join(timeout)

    def kill(self):
        pass


def fake_serve(conn, plan, stem, die_after=None, first_push_shapes=None):
    conn.send(("joined", {"rank": plan.rank, "gpu": plan.gpu}))
    pushes = 0
    while True:
        message = conn.recv()
        if message[0] != "push":
            return
        channel = ReplayChannel(recording(stem))
        sent = []
        pushes += 1
        mangle = first_push_shapes if pushes == 1 else None  # what a trainer's bad step would send

        def hand_on(index, bucket, channel=channel, sent=sent, mangle=mangle):
            if die_after is not None and index == die_after:
                conn.close()
                raise SystemExit
            shapes = [mangle.get(n, (n, s)) for n, s in shapes_of(bucket)] if mangle else shapes_of(bucket)
            names = json.dumps([n for n, _ in shapes])
            conn.send(("bucket", index, {g.tp_rank: names for g in plan.serves}, bucket.nbytes, len(bucket.slots),
                       shapes))
            sent.append(index)

        def await_ack(index):
            kind, acked, ok, text = conn.recv()
            assert (kind, acked) == ("ack", index)
            return ok, text

        try:
            totals = relay(buckets_of(message[1], channel), settle=lambda: None, hand_on=hand_on, await_ack=await_ack)
        except SystemExit:
            return
        assert channel.finished()
        conn.send(("done", totals))


def fake_spawn(stem, die_after=None, first_push_shapes=None):
    def spawn(plan, spec, env, log_dir, dialect):
        parent, child = multiprocessing.Pipe()
        thread = threading.Thread(target=fake_serve, args=(child, plan, stem, die_after, first_push_shapes),
                                  daemon=True)
        thread.start()
        return Rank(plan, ThreadProcess(thread), parent)
    return spawn


def write_checkpoint_header(path, tensors):
    """A safetensors file's header (names, dtypes, shapes) and zeroed data, as SGLang's model directory holds."""
    header, offset = {}, 0
    for t in tensors:
        header[t["name"]] = {"dtype": {"bfloat16": "BF16", "float32": "F32"}[t["dtype"]], "shape": t["shape"],
                             "data_offsets": [offset, offset + t["nbytes"]]}
        offset += t["nbytes"]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))


@pytest.fixture
async def sglang(aiohttp_server, tmp_path):
    """SGLang serving a checkpoint with the recordings' tensors (both recordings hold the same names and shapes)."""
    calls, refuse = [], set()
    write_checkpoint_header(tmp_path / "model.safetensors", recording("vllm_packed").doc["tensors"])

    async def server_info(request):
        return web.json_response({"tp_size": 1, "dp_size": 1, "base_gpu_id": 3, "gpu_id_step": 1})

    async def model_info(request):
        return web.json_response({"model_path": str(tmp_path)})

    async def update(request):
        body = await request.json()
        names = json.loads(body["serialized_named_tensors"][0])
        calls.append((names, body["flush_cache"], body["load_format"]))
        bad = [n for n in names if n in refuse]
        if bad:
            return web.json_response({"success": False, "message": f"unknown parameter {bad[0]}"}, status=400)
        return web.json_response({"success": True, "message": "Success"})

    app = web.Application()
    app.add_routes([web.get("/server_info", server_info), web.get("/model_info", model_info),
                    web.post("/update_weights_from_tensor", update)])
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), calls, refuse


async def bridge_client(aiohttp_client, url, stem, die_after=None, first_push_shapes=None):
    spawn = fake_spawn(stem, die_after, first_push_shapes)
    return await aiohttp_client(create_bridge_app(BridgeSettings((url,)), spawn=spawn))


JOIN = {"host": "127.0.0.1", "port": 29501, "world_size": 2, "rank_offset": 1, "ranks": 1, "timeout_s": 5}


async def test_vllm_packed_push_loads_each_chunk_and_recovers_after_a_refusal(aiohttp_client, sglang):
    url, calls, refuse = sglang
    client = await bridge_client(aiohttp_client, url, "vllm_packed")
    info = await (await client.get("/bridge/info")).json()
    assert (info["gpus"], info["tp_ranks"]) == ([3], 1)
    r = await client.post("/bridge/join", json={**JOIN, "dialect": "vllm"})
    assert r.status == 200, await r.text()
    rec = recording("vllm_packed")
    push = {"dialect": "vllm", "update_info": rec.doc["update_info"], "packed": True, "buffer_size_bytes": 1024}
    r = await client.post("/bridge/push", json=push)
    body = await r.json()
    assert r.status == 200, body
    assert (body["ok"], body["buckets"], body["tensors"], body["errors"]) == (True, 4, 11, [])
    assert [c[0] for c in calls] == rec.doc["consumer"]["chunks"]
    assert {(c[1], c[2]) for c in calls} == {(False, None)}

    calls.clear()
    refuse.add("model.layers.0.self_attn.q_proj.weight")  # in chunk 1
    r = await client.post("/bridge/push", json={**push, "update_info": {}})  # empty: the last names again
    body = await r.json()
    assert r.status == 502
    assert body["errors"] == [{"worker": url, "message": f"{url}: unknown parameter model.layers.0.self_attn.q_proj.weight"}]
    assert len(calls) == 2  # chunk 0, then the refused chunk 1; chunks 2 and 3 were received and dropped

    calls.clear()
    refuse.clear()
    r = await client.post("/bridge/push", json={**push, "update_info": {}})
    assert (r.status, len(calls)) == (200, 4)  # the next push recovers on the same group


Q = "model.layers.0.self_attn.q_proj.weight"  # in prime-rl's bucket 1 (layer 0), vLLM's packed chunk 1


@pytest.mark.parametrize(("dialect", "stem", "mangle", "reason"), [
    ("primerl", "primerl", {Q: ("model.layers.0.self_attn.q_prj.weight", (16, 16))},
     ("SGLang has no parameter model.layers.0.self_attn.q_prj.weight (SGLang 0.5.17 would drop it with only a log "
     "warning)")),
    ("vllm", "vllm_packed", {Q: (Q, (16, 8))},
     (f"{Q} has shape [16, 8], SGLang's is [16, 16] (SGLang 0.5.17's loader would fail its shape assertion and "
     "stop)")),
])
async def test_a_tensor_sglang_cannot_take_is_refused_before_sglang_then_drained_and_the_next_push_recovers(
        aiohttp_client, sglang, dialect, stem, mangle, reason):
    url, calls, _ = sglang
    client = await bridge_client(aiohttp_client, url, stem, first_push_shapes=mangle)
    assert (await client.post("/bridge/join", json={**JOIN, "dialect": dialect})).status == 200
    push = {"dialect": dialect}
    if dialect == "vllm":
        push |= {"update_info": recording(stem).doc["update_info"], "packed": True, "buffer_size_bytes": 1024}
    r = await client.post("/bridge/push", json=push)
    body = await r.json()
    assert (r.status, body["ok"]) == (502, False)
    assert body["errors"] == [{"worker": url, "message": f"{url}: refused by the weight bridge: {reason}"}]
    assert len(calls) == 1  # bucket 0 loaded; bucket 1 never reached SGLang; the rest was received and dropped
    assert (await (await client.get("/bridge/info")).json())["joined"] == [1]  # drained: the group is kept
    calls.clear()
    r = await client.post("/bridge/push", json=push)
    assert (r.status, (await r.json())["errors"]) == (200, [])
    assert [n for c in calls for n in c[0]] == [t["name"] for t in recording(stem).doc["tensors"]]


async def test_primerl_push(aiohttp_client, sglang):
    url, calls, _ = sglang
    client = await bridge_client(aiohttp_client, url, "primerl")
    assert (await client.post("/bridge/join", json={**JOIN, "dialect": "primerl"})).status == 200
    r = await client.post("/bridge/push", json={"dialect": "primerl"})
    body = await r.json()
    assert (r.status, body["buckets"], body["tensors"]) == (200, 3, 11)
    assert [n for c in calls for n in c[0]] == [t["name"] for t in recording("primerl").doc["tensors"]]


async def test_a_receiver_that_dies_mid_push_is_reported_and_the_group_dropped(aiohttp_client, sglang):
    url, _, _ = sglang
    client = await bridge_client(aiohttp_client, url, "primerl", die_after=1)
    assert (await client.post("/bridge/join", json={**JOIN, "dialect": "primerl"})).status == 200
    r = await client.post("/bridge/push", json={"dialect": "primerl"})
    body = await r.json()
    assert r.status == 502
    assert body["errors"] == [{"worker": url, "message": "rank 1 (GPU 3) died (exit code None)",
                              "torn": True}]
    assert (await (await client.get("/bridge/info")).json())["joined"] == []
    r = await client.post("/bridge/push", json={"dialect": "primerl"})
    assert r.status == 400
    assert "no trainer group is joined" in (await r.json())["error"]["message"]


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/bridge/join", {**JOIN, "dialect": "sglang"}, "dialect", "dialect must be one of primerl, vllm"),
    ("/bridge/join", {**JOIN, "dialect": "vllm", "world_size": 3, "ranks": 2}, "ranks",
     "gives this bridge 2 rank(s), but it serves 1 SGLang GPU(s)"),
    ("/bridge/join", {**JOIN, "dialect": "vllm", "port": "x"}, "port", "port must be an integer"),
    ("/bridge/join", {**JOIN, "dialect": "vllm", "timeout_s": "x"}, "timeout_s", "positive number of seconds"),
    ("/bridge/push", {"dialect": "vllm", "update_info": {"names": ["a"]}}, "update_info", "differ in length"),
])
async def test_bad_requests_name_the_param(aiohttp_client, sglang, path, body, param, message):
    client = await bridge_client(aiohttp_client, sglang[0], "vllm_packed")
    r = await client.post(path, json=body)
    error = (await r.json())["error"]
    assert (r.status, error["param"]) == (400, param)
    assert message in error["message"]
