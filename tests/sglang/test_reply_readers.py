"""The one reader of each SGLang reply shape (sglang/replies.py), as the data path and the admin fan-out both
read it: SGLang's words in an error body, sglang-router's GET /workers, a reply's weight version."""

from __future__ import annotations

import orjson
import pytest

from token_proxy.errors import BackendUnavailable
from token_proxy.sglang import WorkerReply
from token_proxy.sglang.replies import error_from_status, message_of, router_workers, version_text


@pytest.mark.parametrize(("body", "words"), [
    ({"error": {"message": "bad ids", "code": 400}}, "bad ids"),  # SGLang's OpenAI-shaped error
    ({"error": "no such group"}, "no such group"),
    ({"success": False, "message": "Failed to update weights"}, "Failed to update weights"),  # an admin route
    ({"error_message": "tp mismatch"}, "tp mismatch"),
    ({"detail": "Not Found"}, "Not Found"),  # FastAPI's own
    ({"object": "error", "message": 7}, "7"),
    ({"success": True}, None),
    (["not", "a", "dict"], None),
])
def test_sglang_words_are_read_by_one_rule(body, words):
    assert message_of(body) == words
    reply = WorkerReply("http://w", 400, orjson.dumps(body), "application/json")
    assert reply.message == (words or "HTTP 400")


def test_the_data_path_and_the_fan_out_quote_the_same_words():
    body = orjson.dumps({"detail": "Method Not Allowed"})
    assert error_from_status(405, body).message == "SGLang failed with HTTP 405: Method Not Allowed"
    assert WorkerReply("http://w", 405, body, "application/json").message == "Method Not Allowed"
    assert WorkerReply("http://w", 0, error=BackendUnavailable("refused")).message == "refused"
    assert WorkerReply("http://w", 502, b"  upstream gone \n", "text/plain").message == "upstream gone"


def test_the_routers_worker_list_is_parsed_once():
    listed = {"workers": [{"url": "http://a:30000/", "id": "5f1c"}, {"url": "http://b:30000"},
                          {"id": "no-url"}, {"url": ""}, "junk"]}
    assert router_workers(orjson.dumps(listed)) == {"http://a:30000": "5f1c", "http://b:30000": "http://b:30000"}
    assert router_workers(orjson.dumps({"workers": []})) == {}
    for not_a_list in (b'{"detail":"Not Found"}', b"[1, 2]", b"<html>", b'{"workers": {"url": "x"}}'):
        assert router_workers(not_a_list) is None


def test_a_replys_weight_version_is_text_and_only_from_a_success():
    def model_info(status: int, body: dict) -> WorkerReply:
        return WorkerReply("http://w", status, orjson.dumps(body), "application/json")

    assert model_info(200, {"weight_version": 3}).weight_version == "3"
    assert model_info(200, {"weight_version": "v2"}).weight_version == "v2"
    assert model_info(200, {"model_path": "m"}).weight_version is None
    assert model_info(500, {"weight_version": "v2"}).weight_version is None
    assert model_info(200, {"success": False, "weight_version": "v2"}).weight_version is None
    assert (version_text(None), version_text(0), version_text("1")) == (None, "0", "1")
