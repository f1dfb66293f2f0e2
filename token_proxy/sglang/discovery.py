"""The connection to SGLang: what start-up learns from it (discovery: BackendInfo and the tokenizer it
names) and the loop that connects, setting it on the shared ProxyContext (state.py).

The port opens at once. Until the first successful discovery the engine-facing fields raise
BackendUnavailable (a 503 naming the reason); the loop keeps trying, with a capped backoff, and
says what went wrong each time (connection refused, HTTP status N, timeout). A tokenizer that
cannot be loaded is a configuration error, not a wait: the loop stops and reports it as fatal.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from token_proxy.errors import ProxyError
from token_proxy.settings import Settings
from token_proxy.sglang.client import SGLangClient
from token_proxy.sglang.versions import KNOWN_RANGE, VERIFIED_FEATURES, SGLangFeatures, features_for
from token_proxy.state import CONTEXT, ON_FATAL, ProxyContext
from token_proxy.tokenization.loader import (
    describe_tokenizer,
    load_tokenizer,
    tokenizer_dir_problem,
)
from token_proxy.tokenization.renderer import PromptRenderer
from token_proxy.tokenization.token_text import TokenTexts
from token_proxy.tools import choose_tool_parser

log = logging.getLogger(__name__)


# --- what SGLang says about itself -------------------------------------------------------------

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
    # KV capacity (tokens) and page size: vLLM's cache_config_info as num_gpu_blocks x block_size.
    max_total_num_tokens: int | None = None
    page_size: int = 1
    # The API generation (server_info `version`): what differs between SGLang releases (sglang_api.py).
    api: SGLangFeatures = VERIFIED_FEATURES


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
        max_total_num_tokens=_positive_int(server_info.get("max_total_num_tokens")),
        page_size=_positive_int(server_info.get("page_size")) or 1,
        api=features_for(server_info.get("version")),
    )
    if not info.incremental_stream:
        log.warning("SGLang streams cumulatively (every event repeats the whole output): the proxy "
                    "does O(n^2) work per stream. Start SGLang with --incremental-streaming-output.")
    if not info.api.exact:
        log.warning("%s: the proxy knows SGLang %s to %s", info.api.describe(), *KNOWN_RANGE)
    return info


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


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


# --- connecting --------------------------------------------------------------------------------

class TokenizerLoadError(Exception):
    """The tokenizer cannot be loaded here: a configuration error, not something to wait out."""


async def connect(ctx: ProxyContext, max_delay_s: float = 5.0, clock=time.monotonic,
                  before_load: Callable[[], None] | None = None) -> None:
    """Retry (with a capped backoff) until SGLang is healthy and discovered. Logs each wait at INFO
    until `settings.backend_wait_s` has passed, then at WARNING. An unloadable tokenizer raises.
    `before_load` runs in the loading thread once the tokenizer library is imported (_load_tokenizer)."""
    start, delay = clock(), 0.2
    while True:
        try:
            problem = await ctx.client.health_problem()
            if problem is None:
                await _connect_once(ctx, before_load)
                log.info("serving %s (context %d) from %s: %s", ctx.backend.served_model_name,
                         ctx.backend.max_model_len, ctx.client.base_url, ctx.backend.api.describe())
                return
            ctx.last_error = f"its /health: {health_hint(problem, ctx.client.base_url)}"
        except (ProxyError, RuntimeError, OSError, ValueError) as exc:
            ctx.last_error = getattr(exc, "message", None) or str(exc)
        waited = clock() - start
        level = logging.WARNING if waited >= ctx.settings.backend_wait_s else logging.INFO
        log.log(level, "waiting for SGLang at %s (%.0f s so far): %s", ctx.client.base_url, waited,
                ctx.last_error)
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay_s)


def health_hint(problem: str, base_url: str) -> str:
    """What SGLang's /health answered, with the likely fix where the answer points at --backend itself."""
    parts = urllib.parse.urlsplit(base_url)
    if problem == "HTTP status 404":  # every SGLang serves /health: this URL is something else
        return (f"HTTP status 404 for {base_url}/health: no SGLang at this address (--backend must be "
                "SGLang's root URL, e.g. http://HOST:30000, without a route such as /generate)")
    if problem == "connection refused" and parts.port is None and parts.scheme == "http":
        return (f"connection refused on port 80 (--backend {base_url} names no port; SGLang listens on "
                "30000 unless started with --port)")
    return problem


def _load_tokenizer(path: str, before_load: Callable[[], None] | None = None):
    """In an executor thread. The app adopts library loggers here (`before_load`), between the import and
    the load: huggingface_hub gives itself a stderr handler on import, and its download retries would
    otherwise print twice."""
    import transformers  # noqa: F401 -- imported here so its loggers exist before they are adopted

    if before_load is not None:
        before_load()
    return load_tokenizer(path)


async def _connect_once(ctx: ProxyContext, before_load: Callable[[], None] | None = None) -> None:
    """Discover SGLang, load the tokenizer it names, and set both on the context."""
    backend = await discover(ctx.client, ctx.settings)
    problem = tokenizer_dir_problem(backend.tokenizer_path)
    if problem:
        raise TokenizerLoadError(problem)
    ctx.loading_tokenizer = backend.tokenizer_path
    try:
        tokenizer = await asyncio.get_running_loop().run_in_executor(ctx.executor, _load_tokenizer,
                                                                     backend.tokenizer_path, before_load)
    except Exception as exc:  # noqa: BLE001 -- transformers raises OSError, ValueError, KeyError, ... for a bad tokenizer
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise TokenizerLoadError(f"cannot load the tokenizer {backend.tokenizer_path!r}: {reason} "
                                 "(pass --tokenizer with a local directory or a Hugging Face id)") from None
    finally:
        ctx.loading_tokenizer = None
    ctx.set_connected(backend, describe_tokenizer(tokenizer),
                      PromptRenderer(tokenizer, ctx.executor, ctx.settings.prompt_cache_size,
                                     busy=lambda: bool(ctx.in_flight), cache_bytes=ctx.settings.prompt_cache_bytes,
                                     # the longest prompt resolve_max_tokens lets through (one token of room)
                                     max_prompt_ids=min(backend.max_prompt_len or backend.max_model_len,
                                                        backend.max_model_len - 1)),
                      TokenTexts(tokenizer), _tool_parser(ctx, tokenizer))


def _tool_parser(ctx: ProxyContext, tokenizer) -> str | None:
    """--tool-call-parser, else the parser the tokenizer's chat template names (logged either way)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default")
    chosen = choose_tool_parser(ctx.settings.tool_call_parser, template if isinstance(template, str) else None)
    if ctx.settings.enable_auto_tool_choice and chosen is None:
        log.error("--enable-auto-tool-choice requires --tool-call-parser (the chat template names no parser): "
                  "tool_choice \"auto\" is refused until one is given")
    return chosen


async def keep_connected(app: web.Application, before_load: Callable[[], None] | None = None) -> None:
    """The background task behind start-up: connect, or report a fatal configuration error."""
    ctx = app[CONTEXT]
    try:
        await connect(ctx, before_load=before_load)
    except TokenizerLoadError as exc:
        ctx.fatal = ctx.last_error = str(exc)
        log.error("%s", exc)
        on_fatal = app.get(ON_FATAL)
        if on_fatal is not None:
            on_fatal(str(exc))


async def wait_until_connected(app: web.Application, timeout_s: float) -> bool:
    """For tests and tools: wait (bounded) until SGLang is known; False if it is not."""
    end = time.monotonic() + timeout_s
    ctx = app[CONTEXT]
    while not ctx.connected and ctx.fatal is None and time.monotonic() < end:
        await asyncio.sleep(0.02)
    return ctx.connected
