"""SGLang's /v1/tokenize and /v1/detokenize (0.5.17: entrypoints/openai/serving_tokenize.py), on the simulator's
own tokenizer: the proxy encodes a probe on both sides at start-up to prove its tokenizer is SGLang's."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
from aiohttp import web

from token_proxy.simulator.errors import json_response
from token_proxy.simulator.state import SIM_STATE

# transformers' model_max_length when tokenizer_config.json sets none (VERY_LARGE_INTEGER)
_NO_LIMIT = int(1e30)


def _error(message: str) -> web.Response:
    """OpenAIServingBase.create_error_response: an OpenAI ErrorResponse at the top level."""
    return json_response({"object": "error", "message": message, "type": "BadRequestError", "param": None,
                          "code": 400}, 400)


def model_max_length(tokenizer_path: str) -> int:
    try:
        config = json.loads((Path(tokenizer_path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return _NO_LIMIT
    limit = config.get("model_max_length")
    return limit if isinstance(limit, int) else _NO_LIMIT


async def _json(request: web.Request) -> dict | None:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None


async def tokenize(request: web.Request) -> web.Response:
    sim, body = request.app[SIM_STATE], await _json(request)
    if body is None:
        return _error("Invalid request body: expected a JSON object")
    prompt, special = body.get("prompt"), body.get("add_special_tokens", True) is not False
    encode = sim.tokenizer.encode
    if isinstance(prompt, str):
        tokens = encode(prompt, add_special_tokens=special).ids
        count = len(tokens)
    elif isinstance(prompt, list) and all(isinstance(text, str) for text in prompt):
        tokens = [encode(text, add_special_tokens=special).ids for text in prompt]
        count = [len(ids) for ids in tokens]
    else:  # `messages` needs SGLang's chat template manager: not simulated
        return _error(f"Invalid prompt type: {type(prompt)}. Expected str or List[str].")
    return json_response({"tokens": tokens, "count": count,
                          "max_model_len": model_max_length(str(sim.config.tokenizer_path))})


async def detokenize(request: web.Request) -> web.Response:
    sim, body = request.app[SIM_STATE], await _json(request)
    tokens = (body or {}).get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        return _error("Invalid input: 'tokens' must be a list of integers.")
    skip = (body or {}).get("skip_special_tokens", True) is not False
    return json_response({"text": sim.tokenizer.decode(tokens, skip_special_tokens=skip)})


def add_tokenize_routes(app: web.Application) -> None:
    for path in ("/v1/tokenize", "/tokenize"):
        app.router.add_post(path, tokenize)
    for path in ("/v1/detokenize", "/detokenize"):
        app.router.add_post(path, detokenize)
