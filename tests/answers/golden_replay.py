"""Real SGLang 0.5.17 replies behind the proxy: the simulator answers the proxy's start-up questions, and
POST /generate is answered with the golden recording (../shared/golden, tests/support/golden.py) of the
same request, its bytes as SGLang sent them (streams verbatim). So the proxy's answers over real SGLang
bytes (its meta_info, its float spellings, its cumulative stream events) are compared too.

A request matches a recording when it asks for the same prompt ids, stream flag and the sampling fields that
shape the reply (GOLDEN_KEYS); the first recording in file order that matches answers it.
"""

from __future__ import annotations

import json
from functools import cache

import orjson
from aiohttp import web

from tests.support.golden import golden_file

FILES = ("generate_nonstream.json", "generate_stream.json")
SAMPLING_KEYS = ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "logit_bias", "n", "ignore_eos")
TOP_KEYS = ("return_logprob", "top_logprobs_num", "token_ids_logprob")
# What the absence of a key means (the proxy spells some defaults out).
DEFAULTS = {"n": 1, "stop": [], "stop_token_ids": [], "return_logprob": False, "top_logprobs_num": 0,
            "ignore_eos": False, "min_new_tokens": 0, "logit_bias": {}}


def available() -> bool:
    return all(golden_file(name, optional=True) is not None for name in FILES)


def _single(record: dict) -> bool:
    """A 200 reply to one prompt of ids with one set of sampling params (the form the proxy sends)."""
    payload = record["request"].get("json") or {}
    ids = payload.get("input_ids")
    return (record["status"] == 200 and isinstance(ids, list) and all(isinstance(i, int) for i in ids)
            and isinstance(payload.get("sampling_params", {}), dict))


@cache
def _records() -> tuple[dict, ...]:
    return tuple(record for name in FILES for record in json.loads(golden_file(name).read_text()) if _single(record))


def key(payload: dict) -> tuple:
    """What of a /generate payload decides the recorded reply."""
    params = payload.get("sampling_params") or {}
    value = lambda source, name: source.get(name) if source.get(name) is not None else DEFAULTS.get(name)
    return (json.dumps(payload.get("input_ids")), bool(payload.get("stream")),
            *(json.dumps(value(params, name), sort_keys=True) for name in SAMPLING_KEYS),
            *(json.dumps(value(payload, name), sort_keys=True) for name in TOP_KEYS))


def recorded_reply(payload: dict) -> tuple[str, bytes]:
    """(content type, body) of the recording for this payload; LookupError names the payload when none."""
    wanted = key(payload)
    for record in _records():
        if key(record["request"]["json"]) == wanted:
            if "body_text" in record:
                return record["headers"]["content-type"], record["body_text"].encode()
            return record["headers"]["content-type"], orjson.dumps(record["body"])
    raise LookupError(f"no golden SGLang reply for {orjson.dumps(payload).decode()[:400]}")


@web.middleware
async def replay_generate(request: web.Request, handler):
    """Put first in the simulator's middlewares: /generate from the recordings, the rest from the simulator."""
    if request.path != "/generate" or request.method != "POST":
        return await handler(request)
    try:
        content_type, body = recorded_reply(await request.json())
    except LookupError as exc:
        return web.json_response({"error": {"message": str(exc)}}, status=500)
    return web.Response(body=body, headers={"Content-Type": content_type})
