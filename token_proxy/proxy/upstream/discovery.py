"""Start-up discovery: wait for SGLang, then learn its model, tokenizer, context and stream mode."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from token_proxy.errors import ProxyError
from token_proxy.proxy.upstream.client import SGLangClient
from token_proxy.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BackendInfo:
    served_model_name: str
    tokenizer_path: str
    max_model_len: int
    # SGLang's --incremental-streaming-output: stream events carry deltas, not everything so far.
    incremental_stream: bool
    weight_version: str | None = None
    model_path: str | None = None  # what SGLang loaded at start (what /reload_weights returns to)
    # SGLang refuses prompts of max_req_input_len tokens or more (context - 6 by default).
    max_prompt_len: int | None = None
    # SGLang reads sampling_seed only with --enable-deterministic-inference; otherwise it ignores it.
    honours_seed: bool = False


async def discover(client: SGLangClient, settings: Settings) -> BackendInfo:
    model_info = await _first_json(client, "/model_info", "/get_model_info")
    server_info = await _first_json(client, "/server_info", "/get_server_info")
    tokenizer = settings.tokenizer or model_info.get("tokenizer_path") or model_info.get("model_path")
    if not tokenizer:
        raise RuntimeError("SGLang reports no tokenizer_path; pass --tokenizer")
    info = BackendInfo(
        served_model_name=settings.served_model_name or server_info.get("served_model_name")
        or model_info.get("model_path") or "default",
        tokenizer_path=tokenizer,
        max_model_len=settings.context_length or await _context_length(client, server_info),
        incremental_stream=bool(server_info.get("incremental_streaming_output")
                                or server_info.get("stream_output")),
        weight_version=model_info.get("weight_version"),
        model_path=model_info.get("model_path"),
        max_prompt_len=_max_prompt_len(server_info),
        honours_seed=bool(server_info.get("enable_deterministic_inference")),
    )
    if not info.incremental_stream:
        log.warning("SGLang streams cumulatively (every event repeats the whole output): the proxy "
                    "does O(n^2) work per stream. Start SGLang with --incremental-streaming-output.")
    return info


def _max_prompt_len(server_info: dict) -> int | None:
    limit = server_info.get("max_req_input_len")
    return limit - 1 if isinstance(limit, int) and limit > 1 else None


async def _context_length(client: SGLangClient, server_info: dict) -> int:
    """/v1/models carries the model's real max_model_len; server args may only hold an override."""
    try:
        models = await client.get_json("/v1/models")
        for card in models.get("data", []):
            if isinstance(card.get("max_model_len"), int):
                return card["max_model_len"]
    except ProxyError as exc:
        log.info("no /v1/models on SGLang (%s); using server_info", exc.message)
    if isinstance(server_info.get("context_length"), int):
        return server_info["context_length"]
    raise RuntimeError("cannot learn the context length from SGLang; pass --context-length")


async def _first_json(client: SGLangClient, *paths: str) -> dict:
    """Newer SGLang names first, older ones after (0.5.x keeps both)."""
    last: ProxyError | None = None
    for path in paths:
        try:
            data = await client.get_json(path)
            if isinstance(data, dict):
                return data
        except ProxyError as exc:
            last = exc
    raise RuntimeError(f"SGLang answered none of {paths}: {last.message if last else 'not an object'}")
