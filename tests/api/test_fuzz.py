"""Fuzzing request validation against a live proxy in front of the simulator.

Malformed bodies (wrong types, huge numbers, NaN literals, deep nesting, invalid UTF-8,
truncated JSON, arrays, unknown roles, enormous strings) must get a 4xx with OpenAI's
error body, valid ones a 200 in the documented shape: never a 5xx, never a hang.
Hypothesis and schemathesis (driven by the proxy's own /openapi.json) run in a worker
thread while the test's event loop serves the proxy. `pytest -s` prints the case count.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections import Counter
from typing import NamedTuple

import orjson
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from token_proxy import http_io

REQUEST_TIMEOUT_S = 10.0  # a request that takes longer counts as a hang
CONTEXT_LEN = 128  # small, so a valid request that asks for "the rest of the context" stays cheap
FUZZ_SETTINGS = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                         suppress_health_check=list(HealthCheck))
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 408: "RequestTimeoutError",
               413: "RequestEntityTooLargeError"}
STATUSES: Counter = Counter()  # every fuzz request of the session, by status
SOURCES: Counter = Counter()  # and by which fuzzer sent it

MESSAGES = [{"role": "user", "content": "hi"}]
VALID = {
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 4},
    "/v1/chat/completions/tokens": {"messages": MESSAGES, "tokens": [9707, 11], "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/inference/v1/generate": {"token_ids": [9707, 11], "sampling_params": {"max_tokens": 4}},
    "/tokenize": {"messages": MESSAGES},
    "/v1/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [9707, 11]},
    "/v1/detokenize": {"tokens": [9707]},
}
# Fields inside objects, as key paths from the body.
NESTED = {
    "messages": [("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
                 ("messages", 0, "tool_calls"), ("messages", 0, "content", 0)],
    "sampling_params": [("sampling_params", k) for k in ("max_tokens", "n", "temperature", "top_k", "stop",
                                                         "logprobs", "seed", "stop_token_ids", "logit_bias")],
}
NASTY_STRINGS = ["", " ", "\x00", "\ud800", "\u2028", "\u202e", "\U0001F600" * 50, "a" * 100_000,
                 "<|im_end|>", "{{ 1/0 }}", "\r\nX-Injected: 1", "%s%n", "🤖" * 3000]
HUGE_NUMBERS = [2**63, 2**64, -(2**63) - 1, 10**30, 10**400, 1e308, -1e308, 1e-320,
                float("nan"), float("inf"), float("-inf")]
# "role" values other than the six a chat message may have.
ROLES = st.one_of(st.text(max_size=12), st.sampled_from(["User", "system ", "bot", "", "tool_call"]))


class Reply(NamedTuple):
    status: int
    content_type: str
    body: bytes


class Sender:
    """Blocking sends for code in a worker thread; the proxy runs on the test's event loop."""

    def __init__(self, client, source: str):
        self.client = client
        self.source = source
        self.loop = asyncio.get_running_loop()

    def post(self, path: str, raw: bytes) -> Reply:
        future = asyncio.run_coroutine_threadsafe(self._post(path, raw), self.loop)
        return future.result(REQUEST_TIMEOUT_S + 5)

    async def _post(self, path: str, raw: bytes) -> Reply:
        reply = await asyncio.wait_for(send(self.client, path, raw), REQUEST_TIMEOUT_S)
        record(self.source, reply.status)
        return reply


async def send(client, path: str, raw: bytes | None) -> Reply:
    async with client.post(path, data=raw, headers={"Content-Type": "application/json"}) as resp:
        return Reply(resp.status, resp.content_type, await resp.read())


def record(source: str, status: int) -> None:
    STATUSES[status] += 1
    SOURCES[source] += 1


def dumps(body) -> bytes:
    """JSON as a careless client writes it: NaN/Infinity literals and ints past 64 bits included."""
    return json.dumps(body, allow_nan=True).encode()


def assert_error(reply: Reply, status: int, param: str | None = ...) -> dict:
    assert reply.status == status, reply.body[:500]
    assert reply.content_type == "application/json"
    body = orjson.loads(reply.body)
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["type"] == ERROR_TYPES[status]
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] is None or isinstance(error["param"], str)
    if param is not ...:
        assert error["param"] == param, error
    return error


class Checker:
    """What any reply to a fuzzed body must look like."""

    def __init__(self, spec: dict):
        self.spec = spec

    def check(self, path: str, raw: bytes, reply: Reply) -> None:
        assert reply.status < 500, (path, raw[:300], reply)
        if not _is_json_object(raw):
            assert_error(reply, 400, "body")
        elif reply.status == 200:
            self.check_ok(path, raw, reply)
        else:
            assert reply.status in (400, 404), (path, raw[:300], reply)
            error = assert_error(reply, reply.status)
            if reply.status == 404:
                assert error["param"] == "model"

    def check_ok(self, path: str, raw: bytes, reply: Reply) -> None:
        if reply.content_type == "text/event-stream":
            check_sse(reply.body)
            return
        assert reply.content_type == "application/json"
        schema = self.spec["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
        Draft202012Validator(schema).validate(orjson.loads(reply.body))


def check_sse(body: bytes) -> None:
    frames = body.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""], body[-200:]
    for frame in frames[:-2]:
        assert frame.startswith(b"data: ")
        chunk = orjson.loads(frame[6:])
        assert "error" not in chunk, chunk
        assert isinstance(chunk["choices"], list)


def _is_json_object(raw: bytes) -> bool:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(body, dict) and http_io._encodable(body)


@pytest.fixture
async def fuzz_proxy(make_sim, make_proxy):
    return await make_proxy(await make_sim(context_length=CONTEXT_LEN))


@pytest.fixture
async def spec(fuzz_proxy) -> dict:
    resp = await fuzz_proxy.get("/openapi.json")
    assert resp.status == 200
    return await resp.json()


# --- strategies ---------------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from(HUGE_NUMBERS),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.sampled_from(NASTY_STRINGS),
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _fields(spec: dict, path: str) -> list[tuple]:
    schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    variants = schema.get("anyOf", [schema])
    keys = sorted({key for v in variants for key in v["properties"]})
    nested = [p for key in keys for p in NESTED.get(key, [])]
    return [(key,) for key in keys] + nested


def _put(body: dict, keys: tuple, value) -> None:
    """body[k0][k1]... = value; where the path ends early (a scalar, a list), that part takes the value."""
    node = body
    for depth, key in enumerate(keys):
        if isinstance(node, list) and not (isinstance(key, int) and key < len(node)):
            node.append(value)
            return
        child = node.get(key) if isinstance(node, dict) else node[key]
        if depth == len(keys) - 1 or not isinstance(child, (dict, list)):
            node[key] = value
            return
        node = child


@st.composite
def mutated_bodies(draw, path: str, fields: list[tuple]) -> bytes:
    body = copy.deepcopy(VALID[path])
    for keys in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        value = draw(ROLES) if keys[-1] == "role" and draw(st.booleans()) else draw(json_values)
        _put(body, keys, value)
    raw = dumps(body)
    return draw(st.sampled_from([raw, raw, raw, *_corruptions(draw, raw)]))


def _corruptions(draw, raw: bytes) -> list[bytes]:
    cut = draw(st.integers(0, len(raw) - 1))
    return [
        raw[:cut],  # truncated
        raw[:cut] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]))
        + raw[cut:],  # invalid UTF-8
        b"[" + raw + b"]",  # an array, not an object
        b'{"a":' * 300 + raw + b"}" * 300,  # valid JSON, nested past what the proxy re-encodes
    ]


garbage = st.one_of(
    st.binary(max_size=200), st.just(b""), st.just(b"   \n"), st.just(b"null"), st.just(b"[]"),
    st.just(b"[" * 10_000 + b"]" * 10_000), st.just(b'{"a":' * 10_000 + b"1" + b"}" * 10_000),
    st.builds(dumps, json_values),
)


# --- (a) hypothesis: malformed bodies on every route ------------------------------------------

@pytest.mark.parametrize("path", sorted(VALID))
async def test_mutated_bodies_get_4xx_or_a_valid_200(fuzz_proxy, spec, path):
    sender, checker = Sender(fuzz_proxy, "hypothesis"), Checker(spec)
    reply = await send(fuzz_proxy, path, dumps(VALID[path]))
    assert reply.status == 200, reply  # the base every mutation starts from is valid
    seen = Counter()

    @settings(FUZZ_SETTINGS, max_examples=100)
    @given(raw=mutated_bodies(path, _fields(spec, path)))
    def run(raw: bytes) -> None:
        reply = sender.post(path, raw)
        seen[reply.status] += 1
        checker.check(path, raw, reply)

    await asyncio.to_thread(run)
    assert seen[400] > 0 and set(seen) <= {200, 400, 404}, seen


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/inference/v1/generate",
                                  "/tokenize"])
async def test_garbage_bodies_get_400_naming_the_body(fuzz_proxy, spec, path):
    sender, checker = Sender(fuzz_proxy, "garbage"), Checker(spec)

    @settings(FUZZ_SETTINGS, max_examples=40)
    @given(raw=garbage)
    def run(raw: bytes) -> None:
        checker.check(path, raw, sender.post(path, raw))

    await asyncio.to_thread(run)


# --- each kind of bad input, with the exact answer ----------------------------------------------

def _chat(**fields) -> bytes:
    return dumps({"messages": MESSAGES, "max_tokens": 2, **fields})


def _nest(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


CASES = [
    # (path, raw body, status, param)
    ("/v1/chat/completions", b"", 400, "body"),
    ("/v1/chat/completions", b" \r\n\t", 400, "body"),
    ("/v1/chat/completions", _chat()[:-7], 400, "body"),
    ("/v1/chat/completions", b"[" + _chat() + b"]", 400, "body"),
    ("/v1/chat/completions", b'"messages"', 400, "body"),
    ("/v1/chat/completions", b"[" * 10_000 + b"]" * 10_000, 400, "body"),
    ("/v1/chat/completions", b'{"a":' * 10_000 + b"1" + b"}" * 10_000, 400, "body"),
    ("/v1/chat/completions", _chat(x=json.loads(_nest(300))), 400, "body"),
    ("/v1/chat/completions", f'{{"messages":[{{"role":"user","content":"hi","x":{_nest(300)}}}]}}'.encode(),
     400, "body"),
    ("/tokenize", f'{{"messages":[{{"role":"user","content":"hi","x":{_nest(300)}}}]}}'.encode(), 400, "body"),
    ("/v1/chat/completions", _chat(structured_outputs={"json": json.loads(_nest(300))}), 400, "body"),
    ("/v1/chat/completions", _chat(chat_template_kwargs={"x": json.loads(_nest(300))}), 400, "body"),
    ("/v1/chat/completions", _chat().replace(b'"hi"', b'"h\xff\xfei"'), 400, "body"),
    ("/v1/chat/completions", _chat().replace(b'"hi"', b'"\\ud800"'), 400, "body"),
    ("/v1/chat/completions", _chat(temperature=float("nan")), 400, "body"),
    ("/v1/chat/completions", _chat(temperature=float("inf")), 400, "body"),
    ("/v1/chat/completions", _chat(top_p=float("-inf")), 400, "body"),
    ("/v1/chat/completions", _chat().replace(b'"max_tokens": 2', b'"max_tokens": 1e309'), 400, "body"),
    ("/v1/chat/completions", _chat(priority=10**30), 400, "priority"),  # orjson reads it as a float
    ("/v1/chat/completions", _chat(priority=1e30), 400, "priority"),
    ("/v1/chat/completions", _chat(top_k=1e30), 400, "top_k"),
    ("/v1/chat/completions", _chat(min_tokens=1e30), 400, "min_tokens"),
    ("/v1/chat/completions", _chat(seed=1e30), 400, "seed"),
    ("/v1/chat/completions", _chat(max_tokens=1e308), 400, "max_tokens"),
    ("/v1/chat/completions", _chat(n=2**63), 400, "n"),
    ("/v1/chat/completions", _chat(temperature="1"), 400, "temperature"),
    ("/v1/chat/completions", _chat(stream="yes"), 400, "stream"),
    ("/v1/chat/completions", _chat(logprobs=1), 400, "logprobs"),
    ("/v1/chat/completions", _chat(stop=[1]), 400, "stop"),
    ("/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    ("/v1/chat/completions", _chat(messages={"role": "user"}), 400, "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": ["user"], "content": "hi"}]), 400, "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": {"a": 1}, "content": "hi"}]), 400, "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "a" * 200_000}]), 400, "input_tokens"),
    ("/v1/chat/completions", _chat(structured_outputs={"choice": 5}), 400, "structured_outputs"),
    ("/v1/chat/completions", _chat(structured_outputs={"choice": {"a": 1}}), 400, "structured_outputs"),
    ("/v1/chat/completions", _chat(request_id="a\r\nX-Injected: 1"), 400, "request_id"),
    ("/v1/chat/completions", _chat(request_id="\x00"), 400, "request_id"),
    ("/v1/chat/completions", _chat(request_id="r" * 257), 400, "request_id"),
    ("/v1/chat/completions", _chat(model="nope"), 404, "model"),
    ("/v1/completions", dumps({"prompt": "hi", "priority": 1e30}), 400, "priority"),
    ("/v1/completions", dumps({"prompt": "hi", "request_id": "\n"}), 400, "request_id"),
    ("/v1/completions", dumps({"prompt": [1, "a"]}), 400, "prompt"),
    ("/v1/completions", dumps({"prompt": [[]]}), 400, "prompt"),
    ("/v1/completions", dumps({"prompt": [-1]}), 400, "prompt"),
    ("/v1/completions", dumps({"prompt": [2**64]}), 400, "prompt"),
    ("/v1/completions", dumps({"prompt": [10**9]}), 400, "prompt"),
    ("/v1/completions", dumps({"prompt": "a " * 100_000}), 400, "input_tokens"),
    ("/inference/v1/generate", dumps({"token_ids": [1], "sampling_params": {"top_k": 1e30}}), 400,
     "sampling_params.top_k"),
    ("/inference/v1/generate", dumps({"token_ids": [1], "sampling_params": []}), 400, "sampling_params"),
    ("/inference/v1/generate", dumps({"token_ids": [1], "request_id": "\x7f"}), 400, "request_id"),
    ("/inference/v1/generate", dumps({"token_ids": [1.5]}), 400, "token_ids"),
    ("/inference/v1/generate", dumps({"token_ids": [True]}), 400, "token_ids"),
    ("/tokenize", dumps({"prompt": 5}), 400, "prompt"),
    ("/tokenize", dumps({"messages": None}), 400, "messages"),
    ("/detokenize", dumps({"tokens": ["1"]}), 400, "tokens"),
    ("/detokenize", dumps({"tokens": [151665]}), 400, "tokens"),
]


async def test_each_kind_of_bad_input_gets_its_exact_error(fuzz_proxy):
    for path, raw, status, param in CASES:
        reply = await asyncio.wait_for(send(fuzz_proxy, path, raw), REQUEST_TIMEOUT_S)
        record("table", reply.status)
        assert_error(reply, status, param)


# --- (b) the body limit ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted(VALID))
async def test_oversized_body_gets_413(make_sim, make_proxy, path):
    proxy = await make_proxy(await make_sim(context_length=CONTEXT_LEN), max_body_bytes=4096)
    fits = dumps({**VALID[path], "cache_salt": "s" * 3000})
    reply = await send(proxy, path, fits)
    record("body-limit", reply.status)
    assert len(fits) <= 4096 and reply.status == 200, reply
    for size in (4097, 1_000_000):
        big = dumps({**VALID[path], "cache_salt": "s" * size})
        reply = await asyncio.wait_for(send(proxy, path, big), REQUEST_TIMEOUT_S)
        record("body-limit", reply.status)
        assert_error(reply, 413, None)


async def test_oversized_chunked_body_gets_413(make_sim, make_proxy):
    """No Content-Length: the limit holds while the body streams in."""
    proxy = await make_proxy(await make_sim(context_length=CONTEXT_LEN), max_body_bytes=4096)
    big = dumps({"prompt": "a" * 100_000})

    async def chunks():
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    async with proxy.post("/v1/completions", data=chunks()) as resp:
        reply = Reply(resp.status, resp.content_type, await resp.read())
    record("body-limit", reply.status)
    assert_error(reply, 413, None)


async def test_a_body_that_stops_arriving_gets_408(fuzz_proxy, monkeypatch):
    """A client that declares more than it sends must not hold its admission slot for good."""
    monkeypatch.setattr(http_io, "BODY_TIMEOUT_S", 0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", fuzz_proxy.server.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b'{"prompt":')
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
    length = int(head.lower().partition(b"content-length: ")[2].split(b"\r\n")[0])
    body = await asyncio.wait_for(reader.readexactly(length), REQUEST_TIMEOUT_S)
    writer.close()
    record("body-limit", int(head.split()[1]))
    assert head.startswith(b"HTTP/1.1 408 ")
    assert_error(Reply(408, "application/json", body), 408, None)


async def test_a_non_utf8_request_id_header_gets_no_5xx(fuzz_proxy):
    body = dumps({"messages": MESSAGES, "max_tokens": 2})
    reader, writer = await asyncio.open_connection("127.0.0.1", fuzz_proxy.server.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"X-Request-Id: \xff\xfe\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    head = (await asyncio.wait_for(reader.read(), REQUEST_TIMEOUT_S)).partition(b"\r\n\r\n")[0]
    writer.close()
    assert head.split()[1] in (b"200", b"400"), head


# --- (c) schemathesis against the served description ----------------------------------------

def cheap(spec: dict) -> dict:
    """The served schema with n and prompt batches capped at 4: every valid request stays small
    (n=1024 x the whole context with 20 logprobs each is a 300 MB answer). Everything else is as served."""
    spec = copy.deepcopy(spec)

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "n":
                    value["anyOf"][0]["maximum"] = 4
                if key == "maxItems" and value == 1024:
                    node[key] = 4
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(spec)
    return spec


# Rules between fields, or against the prompt's length, that JSON Schema cannot state (the document states
# them in descriptions): a schema-valid body refused by one of these is no disagreement. Any other refusal of a
# schema-valid body (schemathesis' ST202) is one, and so is any acceptance of a schema-invalid one (ST201).
INEXPRESSIBLE = [
    ("tool_choice", "does not match any of the specified `tools`"),  # a named function among `tools`
    ("min_tokens", "must be <= "),  # min_tokens <= max_tokens (or the context left)
    ("sampling_params.min_tokens", "must be <= "),
    ("messages", "Could not render the chat template"),  # the model's template has rules of its own
    ("input_tokens", "maximum context length"),  # the prompt, once tokenized, longer than the context
    ("input_tokens", "prompt cannot be empty"),  # the template renders these messages to nothing
    ("max_tokens", "fills the model's maximum context length"),
]


def positive_data_acceptance(ctx, response, case):
    """schemathesis' check, less the refusals listed in INEXPRESSIBLE."""
    from schemathesis import checks

    try:
        return checks.positive_data_acceptance(ctx, response, case)
    except AssertionError:
        error = orjson.loads(response.content).get("error", {})
        if not any(error.get("param") == param and part in error.get("message", "") for param, part in INEXPRESSIBLE):
            raise
        return None


def generable(spec: dict) -> dict:
    """For positive cases only: chat's stream_options left out (null), which makes its rule (stream_options
    need stream: true) vacuous. schemathesis cannot generate from five rules across fields at once (its
    UnsupportedSchema); a narrower valid space is still valid, so positive_data_acceptance stays sound."""
    spec = copy.deepcopy(spec)
    for path, item in spec["paths"].items():
        if path.startswith("/v1/chat/completions"):
            item["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]["stream_options"] = {
                "type": "null"}
    return spec


async def test_schemathesis_against_the_served_openapi(fuzz_proxy, spec):
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis import checks
    from schemathesis.generation import GenerationMode

    schemas = {GenerationMode.POSITIVE: schemathesis.openapi.from_dict(generable(cheap(spec))),
               GenerationMode.NEGATIVE: schemathesis.openapi.from_dict(cheap(spec))}
    base_url = str(fuzz_proxy.make_url("")).rstrip("/")
    must_hold = {
        GenerationMode.POSITIVE: [checks.not_a_server_error, checks.status_code_conformance,
                                  checks.content_type_conformance, checks.response_schema_conformance,
                                  positive_data_acceptance],
        GenerationMode.NEGATIVE: [checks.not_a_server_error, checks.status_code_conformance,
                                  checks.content_type_conformance, checks.negative_data_rejection],
    }
    operations = {mode: [op.ok() for op in schema.get_all_operations()] for mode, schema in schemas.items()}
    assert {op.path for op in operations[GenerationMode.POSITIVE]} >= set(VALID) | {"/v1/models", "/health"}
    seen = Counter()

    def run_all() -> None:
        import requests

        with requests.Session() as session:
            for mode, mode_checks in must_hold.items():
                for op in operations[mode]:
                    if mode == GenerationMode.POSITIVE or op.method.upper() == "POST":
                        _fuzz_operation(op, mode, mode_checks, session, base_url, seen)

    await asyncio.to_thread(run_all)
    print(f"\nschemathesis: {dict(sorted(seen.items()))}")
    assert seen[("positive", 200)] > 0 and seen[("negative", 400)] > 0, seen


def _fuzz_operation(op, mode, mode_checks, session, base_url: str, seen: Counter) -> None:
    @settings(FUZZ_SETTINGS, max_examples=30 if op.method.upper() == "POST" else 3)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case) -> None:
        response = case.call(base_url=base_url, session=session, timeout=REQUEST_TIMEOUT_S)
        note(f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.content[:300]!r}")
        record("schemathesis", response.status_code)
        seen[(mode.value, response.status_code)] += 1
        case.validate_response(response, checks=mode_checks)
        if response.status_code >= 400:
            content_type = response.headers.get("content-type", [""])[0].split(";")[0]
            assert_error(Reply(response.status_code, content_type, response.content), response.status_code)

    run()


# --- the count ----------------------------------------------------------------------------------

def test_zz_fuzz_report():
    """Last in the file: how many cases ran, and that none got a 5xx."""
    total = sum(STATUSES.values())
    print(f"\nfuzz: {total} requests, statuses {dict(sorted(STATUSES.items()))}, by source {dict(SOURCES)}")
    if not total:
        pytest.skip("run with the rest of tests/api/test_fuzz.py")
    assert all(status < 500 for status in STATUSES), STATUSES
