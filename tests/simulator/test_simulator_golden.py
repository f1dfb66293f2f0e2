"""Replay the golden SGLang 0.5.17 recordings against the simulator: statuses, content types,
key sets and error texts must match (generated token values may differ)."""

from __future__ import annotations

import json

import orjson
import pytest

from tests.support.golden import golden_file
from token_proxy.simulator import SIM_STATE, SimConfig, create_sim_app
from token_proxy.simulator.testing import parse_sse

NONSTREAM = json.loads(golden_file("generate_nonstream.json").read_text())
STREAM = json.loads(golden_file("generate_stream.json").read_text())
ADMIN = {r["name"]: r for r in json.loads(golden_file("admin.json").read_text())}
LOGPROB_KEYS = {
    "input_token_logprobs",
    "output_token_logprobs",
    "output_token_logprobs_length",
    "input_top_logprobs",
    "output_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
}


@pytest.fixture
async def sim(aiohttp_client, tokenizer_dir):
    app = create_sim_app(SimConfig(tokenizer_path=str(tokenizer_dir)))
    return await aiohttp_client(app)


async def send(client, record: dict):
    request = record["request"]
    if "json" in request:
        request = {**request, "json": await adapt_stops(client, request["json"])}
    kwargs = {"json": request["json"]} if "json" in request else {"data": request.get("raw_body", "")}
    response = await client.request(request["method"], request["path"], **kwargs)
    return response, await response.read()


async def adapt_stops(client, body: dict) -> dict:
    """Golden stops name tokens the real model produced ("\\n\\n", id 198); swap in ones the
    simulator's greedy output contains, so the same finish reasons (and shapes) come back."""
    params = body.get("sampling_params")
    if not isinstance(params, dict) or not ({"stop", "stop_token_ids"} & params.keys()):
        return body
    probe = {**params, "stop": None, "stop_token_ids": None}
    response = await client.post("/generate", json={**body, "stream": False, "sampling_params": probe})
    output = orjson.loads(await response.read())
    if "stop" in params:
        params = {**params, "stop": [output["text"][3:6]]}
    if "stop_token_ids" in params:
        params = {**params, "stop_token_ids": [output["output_ids"][0]]}
    return {**body, "sampling_params": params}


def content_type(headers) -> str | None:
    return headers.get("content-type") or headers.get("Content-Type")


def meta_key_shape(meta: dict) -> list[str]:
    """meta_info keys in order; decode_throughput only exists for > 1 completion token."""
    return [k for k in meta if k != "decode_throughput"]


def assert_same_item_shape(ours: dict, theirs: dict) -> None:
    assert list(ours) == list(theirs)
    assert meta_key_shape(ours["meta_info"]) == meta_key_shape(theirs["meta_info"])
    assert ours["meta_info"]["finish_reason"].keys() == theirs["meta_info"]["finish_reason"].keys()
    assert ("decode_throughput" in ours["meta_info"]) == (ours["meta_info"]["completion_tokens"] > 1)
    assert (ours["meta_info"]["cached_tokens_details"] is None) == (ours["meta_info"]["cached_tokens"] == 0)
    for key in LOGPROB_KEYS & theirs["meta_info"].keys():
        assert_logprob_shape(ours["meta_info"][key], theirs["meta_info"][key])


def assert_logprob_shape(ours, theirs) -> None:
    if isinstance(theirs, int):
        assert isinstance(ours, int)
        return
    assert len(ours) == len(theirs)
    for mine, gold in zip(ours, theirs, strict=True):
        if gold is None or isinstance(gold[0], (float, type(None))) and not isinstance(gold[0], list):
            assert (mine is None) == (gold is None)
            if gold is not None:
                assert [type(x) for x in mine] == [type(x) for x in gold]
        else:  # a row of triples
            assert [[type(x) for x in t] for t in mine] == [[type(x) for x in t] for t in gold]


@pytest.mark.parametrize("record", NONSTREAM, ids=[r["name"] for r in NONSTREAM])
async def test_nonstream_golden(sim, record):
    response, raw = await send(sim, record)
    assert response.status == record["status"]
    assert content_type(response.headers) == record["headers"]["content-type"]
    body = record.get("body", record.get("body_text"))
    if response.status != 200:
        assert (raw.decode() if isinstance(body, str) else orjson.loads(raw)) == body
        return
    ours = orjson.loads(raw)
    if isinstance(body, list):
        assert len(ours) == len(body)
        for mine, gold in zip(ours, body, strict=True):
            assert_same_item_shape(mine, gold)
    else:
        assert_same_item_shape(ours, body)
        assert (
            len(ours["output_ids"]) <= len(body["output_ids"])
            or body["meta_info"]["finish_reason"]["type"] == "length"
        )


@pytest.mark.parametrize("record", STREAM, ids=[r["name"] for r in STREAM])
async def test_stream_golden(sim, record):
    response, raw = await send(sim, record)
    assert response.status == record["status"]
    assert content_type(response.headers) == record["headers"]["content-type"]
    ours, theirs = parse_sse(raw), record["events_parsed"]
    assert ours[-1] == "[DONE]" and theirs[-1] == "[DONE]"
    if "error" in theirs[0]:
        assert ours == theirs
        return
    assert_stream_event_shapes(ours[:-1], theirs[:-1], bool(record["request"]["json"].get("return_logprob")))


def reference_roles(with_logprobs: bool) -> dict[str, list[str]]:
    """meta_info key lists per event role, pooled over every golden stream of that kind."""
    roles = {}
    for record in STREAM:
        if (
            bool(record["request"]["json"].get("return_logprob")) == with_logprobs
            and "error" not in record["events_parsed"][0]
        ):
            for role, event in _roles(record["events_parsed"][:-1]).items():
                roles.setdefault(role, meta_key_shape(event["meta_info"]))
    return roles


def assert_stream_event_shapes(ours: list[dict], theirs: list[dict], with_logprobs: bool) -> None:
    """Top-level keys, and meta_info keys of first / middle / final events per index."""
    assert {tuple(e) for e in ours} == {tuple(e) for e in theirs}
    gold = reference_roles(with_logprobs)
    for role, event in _roles(ours).items():
        assert meta_key_shape(event["meta_info"]) == gold[role], role
    assert sorted({e.get("index") for e in ours}, key=str) == sorted(
        {e.get("index") for e in theirs}, key=str
    )


def _roles(events: list[dict]) -> dict[str, dict]:
    """Classify each sequence's events: first (not final), middle, final, or first+final."""
    roles, seen = {}, set()
    for event in events:
        key, final = event.get("index"), event["meta_info"]["finish_reason"] is not None
        first = key not in seen
        seen.add(key)
        role = ("first_final" if first else "final") if final else ("first" if first else "middle")
        roles.setdefault(role, event)
    return roles


@pytest.mark.parametrize(
    "name",
    [
        "GET /health",
        "GET /health_generate",
        "GET /ping",
        "POST /flush_cache (idle)",
        "GET /flush_cache (idle)",
        "GET /get_weight_version",
        "POST /abort_request unknown rid",
        "POST /abort_request abort_all idle",
        "POST /update_weights_from_disk same path",
    ],
)
async def test_admin_golden_exact(aiohttp_client, tokenizer_dir, name):
    record = ADMIN[name]
    client = await aiohttp_client(
        create_sim_app(SimConfig(tokenizer_path=str(tokenizer_dir), model_path="/tmp/tiny"))
    )
    response, raw = await send(client, record)
    assert response.status == record["status"]
    assert (content_type(response.headers) or None) == record["headers"].get("content-type")
    assert (
        orjson.loads(raw) if "body" in record and not isinstance(record["body"], str) else raw.decode()
    ) == record.get("body", record.get("body_text"))


@pytest.mark.parametrize(
    "name",
    [
        "GET /get_model_info",
        "GET /model_info",
        "GET /get_load",
        "GET /v1/models",
        "GET /server_info",
        "GET /get_server_info",
    ],
)
async def test_admin_golden_shapes(sim, name):
    record = ADMIN[name]
    response, raw = await send(sim, record)
    assert response.status == 200 and content_type(response.headers) == "application/json"
    ours, theirs = orjson.loads(raw), record["body"]
    if isinstance(theirs, list):  # /get_load
        assert list(ours[0]) == list(theirs[0]) and ours[0]["num_reqs"] == 0
    elif name.endswith("server_info"):
        assert set(ours) <= set(theirs)
        for key in (
            "model_path",
            "tokenizer_path",
            "served_model_name",
            "context_length",
            "max_req_input_len",
            "incremental_streaming_output",
            "version",
            "max_total_num_tokens",
            "internal_states",
        ):
            assert key in ours
        assert (ours["max_req_input_len"], ours["context_length"], ours["version"]) == (4090, 4096, "0.5.17")
        assert ours["internal_states"][0]["weight_version"] == "default"
    elif name == "GET /v1/models":
        assert list(ours) == list(theirs) and list(ours["data"][0]) == list(theirs["data"][0])
        assert ours["data"][0]["max_model_len"] == 4096
    else:
        assert list(ours) == list(theirs)
        assert ours["tokenizer_path"] == str(sim.server.app[SIM_STATE].config.tokenizer_path)
