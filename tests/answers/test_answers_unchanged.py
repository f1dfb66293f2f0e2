"""Every client-facing answer of the proxy, byte for byte, against answers.json (issue 30: the request path
gets faster, its answers stay byte-identical).

tests/answers/cases.py sends a fixed set of requests to every data-plane endpoint (chat with ids, logprobs,
n, stops, JSON schema, tools, sessions, streams; completions; token-in generate; render / derender;
tokenize / detokenize; models, version, health, openapi) and the error answers of bad inputs, through the
proxy app in front of the built-in simulator, in this process (no network, no GPU); the golden/ cases get
real SGLang 0.5.17's recorded /generate replies instead (golden_replay.py; skipped where ../shared/golden
is absent). Each answer's status,
headers (harness.HEADERS) and body bytes must equal the recording once harness.normalize has replaced the
volatile values (drawn ids, `created`, the run's tokenizer folder) by placeholders.

After an intended change to an answer, re-record and commit answers.json with the change:

    PYTHONPATH=$PWD .venv/bin/python -m tests.answers.record

(answers.json was first recorded from main at 209c86b.)
"""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest

from tests.answers import golden_replay
from tests.answers.cases import CASES
from tests.answers.harness import normalize, run_cases
from tests.answers.record import FIXTURE, dumps
from token_proxy.routes import LOCAL, ROUTES

RECORDED: dict[str, dict] = json.loads(FIXTURE.read_text(encoding="utf-8"))
RERECORD = "after an intended change: PYTHONPATH=$PWD .venv/bin/python -m tests.answers.record"
# Served on the data plane but not a fixed answer: counters and timings.
UNRECORDED_PATHS = {"/metrics"}


def first_difference(expected: str, got: str, context: int = 60) -> str:
    """Where two answers first differ, with a little of each around it (None when equal)."""
    if expected == got:
        return None
    a, b = expected.encode(), got.encode()
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, at - context)
    return (f"first difference at byte {at} (lengths {len(a)} recorded, {len(b)} now):\n"
            f"  recorded: ...{a[start:at + context]!r}\n"
            f"  now:      ...{b[start:at + context]!r}")


def assert_same_answer(name: str, step: int, expected: dict, got: dict) -> None:
    where = f"{name}, request {step + 1}"
    assert got["status"] == expected["status"], f"{where}: status {got['status']}, recorded {expected['status']}"
    assert got["headers"] == expected["headers"], f"{where}: headers {got['headers']}, recorded {expected['headers']}"
    difference = first_difference(expected["body"], got["body"])
    assert difference is None, f"{where}: the body changed; {difference}\n({RERECORD})"


@pytest.fixture(scope="module")
def answers(tokenizer_dir) -> dict[str, dict]:
    """Every case's answers now: one run of all cases (a few seconds), shared by the tests below. Each proxy
    loads its tokenizer as `token-proxy` does (not conftest's shared one): a faster encoder is compared too."""
    return asyncio.run(run_cases(tokenizer_dir))


def test_the_recording_holds_every_case():
    assert list(RECORDED) == [case.name for case in CASES], f"cases.py and answers.json differ: {RERECORD}"


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_answer_unchanged(answers, name):
    if name not in answers:
        pytest.skip(f"{name}: replays the golden SGLang recordings, which are not here (tests/support/golden.py)")
    expected, got = RECORDED[name], answers[name]
    assert got["requests"] == expected["requests"], f"{name}: the case's requests changed: {RERECORD}"
    assert len(got["answers"]) == len(expected["answers"])
    for step, (want, have) in enumerate(zip(expected["answers"], got["answers"])):
        assert_same_answer(name, step, want, have)


def test_every_data_plane_route_has_a_case():
    """A route added to the data plane gets a recorded answer too (the admin plane speaks to trainers' control
    loops and SGLang's admin API: its own tests cover it)."""
    covered = {step.path for case in CASES for step in case.steps if not callable(step)}
    served = {route.path for route in ROUTES if route.answered_by == LOCAL and route.served}
    assert served - covered - UNRECORDED_PATHS == set()


def test_a_fresh_recording_is_the_committed_file(answers):
    """The recorder writes exactly answers.json from these answers (its text is the comparison's input)."""
    if not golden_replay.available():
        pytest.skip("the golden SGLang recordings are not here: the golden cases were left out")
    assert dumps(answers) == FIXTURE.read_text(encoding="utf-8")


# --- the normalizer touches only the volatile values ---

RAW = (b'{"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":"chat.completion","created":1764236033,'
       b'"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":'
       b'"chatcmpl-tool-89abcdef01234567","type":"function"}]},"token_ids":[785,3974]}],"root":"/tmp/tok\\\\x"}')


def test_normalize_replaces_only_ids_created_and_paths():
    (got,) = normalize(RAW, paths={"/tmp/tok\\x": "<tokenizer_dir>"})
    assert got == (b'{"id":"chatcmpl-<id1>","object":"chat.completion","created":0,'
                   b'"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":'
                   b'"chatcmpl-tool-<tool1>","type":"function"}]},"token_ids":[785,3974]}],"root":"<tokenizer_dir>"}')


def test_normalize_keeps_a_changed_token_id_spacing_or_key_order():
    (base,) = normalize(RAW)
    for changed in (RAW.replace(b"3974]", b"3975]"), RAW.replace(b'"model":"m"', b'"model": "m"'),
                    RAW.replace(b'"object":"chat.completion","created":1764236033',
                                b'"created":1764236033,"object":"chat.completion"')):
        (other,) = normalize(changed)
        assert other != base
        assert first_difference(base.decode(), other.decode()).startswith("first difference at byte ")


def test_normalize_numbers_ids_so_a_stream_that_changes_its_id_differs():
    one = b'data: {"id":"cmpl-' + b"a" * 32 + b'"}\n\ndata: {"id":"cmpl-' + b"a" * 32 + b'"}\n\n'
    two = b'data: {"id":"cmpl-' + b"a" * 32 + b'"}\n\ndata: {"id":"cmpl-' + b"b" * 32 + b'"}\n\n'
    assert normalize(one) == [b'data: {"id":"cmpl-<id1>"}\n\ndata: {"id":"cmpl-<id1>"}\n\n']
    assert normalize(two) == [b'data: {"id":"cmpl-<id1>"}\n\ndata: {"id":"cmpl-<id2>"}\n\n']
    # a header and the body share the numbering: X-Request-Id names the body's id
    assert normalize(b"chatcmpl-" + b"c" * 32, b'{"id":"chatcmpl-' + b"c" * 32 + b'"}') == [
        b"chatcmpl-<id1>", b'{"id":"chatcmpl-<id1>"}']


def test_a_changed_token_id_in_a_live_answer_fails_the_comparison(answers):
    name = "chat/return_token_ids"
    expected = RECORDED[name]["answers"][0]
    live = answers[name]["answers"][0]
    assert_same_answer(name, 0, expected, live)
    body = orjson.loads(live["body"])
    first = body["choices"][0]["token_ids"][0]
    tampered = {**live, "body": live["body"].replace(f'"token_ids":[{first},', f'"token_ids":[{first + 1},', 1)}
    assert tampered["body"] != live["body"]
    with pytest.raises(AssertionError, match=r"chat/return_token_ids, request 1: the body changed; first difference"):
        assert_same_answer(name, 0, expected, tampered)
