"""The one route table (token_proxy/routes.py): every route and its flags, as the app and the middleware read them."""

from __future__ import annotations

import json

import orjson
import pytest
from aiohttp import web

from token_proxy.api import parse_sampling
from token_proxy.api.sampling import RANGES
from token_proxy.errors import InvalidRequest
from token_proxy.http_io import ROUTE_TABLE, kind_in, route_kind, routes_where
from token_proxy.ids import MAX_ID_CHARS, checked_id
from token_proxy.ops.openapi import Limits, openapi_spec, tool_choices
from token_proxy.route_row import ADMIN, INFERENCE, OPS, OWNER, TOKENIZER
from token_proxy.routes import ROUTES
from token_proxy.serving.process_app import add_serving_plane, forward_to_owner
from token_proxy.sglang.pause import PRIME_RL, VLLM, to_sglang
from token_proxy.state import CONTEXT


def test_every_path_is_one_row_and_the_version_setters_name_their_key():
    paths = [route.path for route in ROUTES]
    assert len(paths) == len(set(paths))
    assert {r.path: r.version_key for r in ROUTES if r.version_key} == {
        "/update_weights_from_disk": "weight_version", "/update_weights_from_distributed": "weight_version",
        "/update_weights_from_tensor": "weight_version", "/update_weight_version": "new_version"}


def test_the_flags_the_middleware_reads():
    assert [r.path for r in ROUTES if r.quiet] == ["/health", "/metrics"]
    assert [r.path for r in ROUTES if r.kind == INFERENCE and r.served] == [
        "/v1/chat/completions", "/v1/chat/completions/tokens", "/v1/completions", "/inference/v1/generate"]
    assert {r.path for r in ROUTES if r.weight_update} == {
        "/update_weights", "/update_weights_from_disk", "/update_weights_from_distributed",
        "/update_weights_from_tensor", "/reload_weights"}
    table = {route.path: route for route in ROUTES}  # as add_routes lists it on the app (http_io.route_kind)
    assert (kind_in(table, "/liveness"), kind_in(table, "/model_info"), kind_in(table, "/generate"),
            kind_in(table, "/pause"), kind_in(table, "/not/listed")) == (OPS, TOKENIZER, INFERENCE, ADMIN, ADMIN)


async def test_the_app_carries_the_table_and_openapi_lists_its_rows(proxy):
    app = proxy.app
    assert app[ROUTE_TABLE]["/v1/completions"].kind == INFERENCE
    assert route_kind(app, "/liveness") == OPS and route_kind(app, "/update_weights") == ADMIN
    listed = routes_where(app, "in_openapi")
    assert "/openapi.json" not in listed and "/metrics" not in listed
    resp = await proxy.get("/openapi.json")
    body = await resp.read()
    assert sorted(orjson.loads(body)["paths"]) == sorted(listed)
    # the handler serves openapi_spec as it is, for the connected engine's limits (nothing filtered)
    ctx = app[CONTEXT]
    limits = Limits(ctx.backend.served_model_name, ctx.tokenizer_info.vocab_size, ctx.max_model_len,
                    tool_choices(ctx.connection.get().tool_parser, ctx.settings.enable_auto_tool_choice))
    assert limits.model == "sim/qwen2-tiny" and body == orjson.dumps(openapi_spec(limits))


def test_openapi_describes_exactly_the_in_openapi_rows():
    """The one check of the table against ops/openapi.py's schemas (both are fixed at import): a row
    flagged in_openapi with no schema, or a schema for a row not flagged, fails here."""
    described = list(openapi_spec()["paths"])
    assert described == [
        "/v1/chat/completions", "/v1/chat/completions/tokens", "/v1/chat/completions/render", "/v1/completions",
        "/inference/v1/generate", "/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize", "/v1/models",
        "/health"]
    assert sorted(described) == sorted(route.path for route in ROUTES if route.in_openapi)


def test_a_serving_process_forwards_exactly_the_owner_rows():
    app = web.Application()
    add_serving_plane(app)
    forwarded = {(route.method, route.resource.canonical) for route in app.router.routes()
                 if route.handler is forward_to_owner and isinstance(route.resource, web.PlainResource)}
    # every OWNER row, SGLang's own listed ones too, for its methods (and HEAD with a GET); else a 405
    assert forwarded == {(method, route.path) for route in ROUTES if route.answered_by == OWNER
                         for method in route.methods + (("HEAD",) if "GET" in route.methods else ())}
    assert ("POST", "/update_weights") in forwarded and ("POST", "/v1/completions") not in forwarded


WRONG_METHODS = [("POST", "/ping", "GET, HEAD"), ("DELETE", "/liveness", "GET, HEAD"),
                 ("PUT", "/health_generate", "GET, HEAD"), ("POST", "/model_info", "GET, HEAD"),
                 ("GET", "/update_weights_from_tensor", "POST"), ("GET", "/pause", "POST"),
                 ("DELETE", "/flush_cache", "GET, POST, HEAD"), ("POST", "/health", "GET, HEAD")]


@pytest.mark.parametrize("method,path,allow", WRONG_METHODS)
async def test_every_row_answers_only_its_methods_open_ones_too(proxy, method, path, allow):
    """A method a row does not list is a 405 with Allow from the proxy, never a pass-through to SGLang
    (before: POST /ping or DELETE /liveness reached SGLang with no key, as open ops rows)."""
    resp = await proxy.request(method, path)
    assert (resp.status, resp.headers["Allow"]) == (405, allow)
    assert await resp.json() == {"error": {"message": f"Method {method} is not allowed on {path}; use {allow}",
                                           "type": "MethodNotAllowedError", "param": None, "code": 405}}


async def test_a_rows_own_methods_still_reach_sglang(proxy):
    for method, path in (("GET", "/ping"), ("GET", "/health_generate"), ("GET", "/liveness"), ("HEAD", "/liveness")):
        resp = await proxy.request(method, path)
        assert resp.status == 200, (method, path, await resp.text())


@pytest.mark.parametrize("path", ["/ping", "/health_generate", "/model_info", "/health", "/v1/models", "/version",
                                  "/liveness", "/get_load"])
async def test_head_is_answered_wherever_get_is(proxy, path):
    """Issue 41.9: HEAD /ping was a 405 (SGLang's FastAPI route takes GET only): the pass-through sends it
    SGLang's GET and answers with the status and headers, no body."""
    got = await proxy.get(path)
    head = await proxy.head(path)
    assert (head.status, got.status) == (200, 200)
    assert await head.read() == b""
    assert head.headers.get("Content-Type", "").split(";")[0] == got.headers.get("Content-Type", "").split(";")[0]


def test_openapi_sampling_ranges_are_the_parsers():
    fields = openapi_spec()["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"][
        "schema"]["properties"]
    assert fields["top_p"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}
    assert fields["n"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": RANGES["n"].hi}
    with pytest.raises(InvalidRequest) as exc:
        parse_sampling({"top_p": 0}, 100)
    assert (exc.value.message, exc.value.param) == ("top_p: must be in (0, 1], got 0.0", "top_p")
    with pytest.raises(InvalidRequest) as exc:
        parse_sampling({"repetition_penalty": 0}, 100)
    assert exc.value.message == "repetition_penalty: must be > 0, got 0.0"


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
AGREEMENT = [  # path, body, whether the proxy takes it (and so /openapi.json allows it)
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream_options": {}}, False),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {}}, True),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, False),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3, "logprobs": False}, False),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3, "logprobs": True}, True),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, False),
    ("/tokenize", {"messages": CHAT["messages"], "continue_final_message": True}, False),
    ("/v1/chat/completions/render", {**CHAT, "tools": []}, False),
    ("/tokenize", {"messages": CHAT["messages"], "tools": []}, True),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, False),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "none"}, True),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999999": 1}}, False),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"+5": 1}}, False),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"\u0665": 1}}, False),  # an Arabic-Indic 5: int() reads it
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"005": 1.5}}, True),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}}, False),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "a", "grammar": None, "choice": []}}, True),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": False}, False),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "seed": -(2**63) - 1}},
     False),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "seed": -(2**63)}}, True),
    ("/inference/v1/generate", {"token_ids": [1, 2], "stream_options": {"include_usage": 1.5}}, False),
]


async def test_openapi_and_the_parsers_agree_on_each_case(proxy):
    """Each body: /openapi.json allows it exactly when the proxy takes it (before: schemathesis found the
    refusals above allowed by the document, and stop_token_ids: false and a seed below int64 taken)."""
    from jsonschema import Draft202012Validator

    spec = await (await proxy.get("/openapi.json")).json()
    for path, body, taken in AGREEMENT:
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        allowed = Draft202012Validator({**schema, "components": spec["components"]}).is_valid(body)
        resp = await proxy.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"})
        await resp.read()
        assert (allowed, resp.status == 200) == (taken, taken), (path, body, allowed, resp.status)


def test_one_id_rule():
    assert checked_id("a" * MAX_ID_CHARS, "request_id") == "a" * MAX_ID_CHARS
    with pytest.raises(InvalidRequest) as exc:
        checked_id("a" * (MAX_ID_CHARS + 1), "request_id")
    assert exc.value.param == "request_id"
    assert exc.value.message == "request_id: must be at most 256 characters, none of them control characters"


@pytest.mark.parametrize("mode,dialect,native", [
    ("keep", PRIME_RL, "retract"), ("abort", PRIME_RL, "abort"), ("in_place", PRIME_RL, "in_place"),
    ("keep", VLLM, "retract"), ("wait", VLLM, "in_place"), ("abort", VLLM, "abort"), ("retract", VLLM, "retract"),
])
def test_pause_modes_map_onto_sglangs(mode, dialect, native):
    assert to_sglang(mode, dialect, configured="retract") == native


def test_a_mode_the_dialect_does_not_name_is_a_400():
    with pytest.raises(InvalidRequest) as exc:
        to_sglang("wait", PRIME_RL, "retract")
    assert exc.value.message == "mode must be keep, abort, retract or in_place, got 'wait'"
    with pytest.raises(InvalidRequest) as exc:
        to_sglang(["abort"], VLLM, "retract")
    assert exc.value.message == "mode must be abort, wait or keep (or SGLang's retract, in_place), got ['abort']"
