"""The connection to SGLang: what start-up learns from the servers that generate (an SGLangPicture,
sglang/picture.py: each server's facts and the agreed ones) and the tokenizer it names, and the loop that
connects, holding the result and the connection's status in one Connection (ProxyContext reads it).

Behind an sglang-router (the --worker flags, else the servers the router lists at /workers) every worker's
/model_info, /server_info and /v1/models are read: the router's own /server_info has none of their settings.
A worker that differs from the first is named in one line (picture.agree says which value is used; a fleet
that disagrees on the stream mode cannot be served and is a configuration error). A single SGLang is read
at its own URL.

The port opens at once. Until the first successful discovery the engine-facing fields raise
BackendUnavailable (a 503 naming the reason); the loop keeps trying, with a capped backoff, and
says what went wrong each time (connection refused, HTTP status N, timeout). A tokenizer that
cannot be loaded is a configuration error, not a wait: the loop stops and reports it as fatal.
Outages after connecting (the /metrics reader notices) are logged here too, one line per edge.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from aiohttp import web

from token_proxy.errors import BackendTimeout, BackendUnavailable, ProxyError
from token_proxy.settings import Settings
from token_proxy.sglang import config_checks
from token_proxy.sglang.client import SGLangClient
from token_proxy.sglang.fleet_view import FleetView
from token_proxy.sglang.picture import BackendInfo, SGLangPicture, picture_of
from token_proxy.sglang.versions import KNOWN_RANGE, features_for
from token_proxy.tokenization.fast_bpe import load_fast_bpe
from token_proxy.tokenization.loader import (
    TokenizerInfo,
    describe_tokenizer,
    load_tokenizer,
    tokenizer_dir_problem,
    unseen_path_problem,
)
from token_proxy.tokenization.renderer import PromptRenderer
from token_proxy.tokenization.token_text import TokenTexts
from token_proxy.tools import choose_tool_parser

log = logging.getLogger(__name__)

__all__ = ["CONNECTION", "ON_FATAL", "BackendInfo", "Connected", "Connection", "SGLangPicture", "discover",
           "keep_connected", "wait_until_connected"]


# --- what SGLang says about itself -------------------------------------------------------------

async def discover(view: FleetView) -> SGLangPicture:
    """Every generating server's facts (the backend itself, or the workers behind a router), agreed; the list
    of them is read through the fleet's live view (`view.list_workers`), which records it."""
    client, settings = view.client, view.settings
    urls = await worker_urls(view)
    servers = [client if url == client.base_url else client.at(url) for url in urls]
    found = await asyncio.gather(*(discover_one(server, settings) for server in servers), return_exceptions=True)
    infos = {url: info for url, info in zip(urls, found) if isinstance(info, BackendInfo)}
    for info in found:
        if isinstance(info, BaseException) and not isinstance(info, (ProxyError, RuntimeError, OSError, ValueError)):
            raise info
    if not infos and client.base_url not in urls:
        # No worker answers as SGLang: the backend itself, when it is one, still says what generates.
        with contextlib.suppress(ProxyError, RuntimeError, OSError, ValueError):
            infos = {client.base_url: await discover_one(client, settings)}
            log.warning("no SGLang worker answered (%s); the proxy's picture of SGLang comes from the backend "
                        "%s itself", ", ".join(urls), client.base_url)
    if not infos:
        raise found[0]
    for url, info in zip(urls, found):
        # One worker down, or answering as no SGLang does, must not keep the fleet's proxy from starting: it is
        # named, and left out of the picture until the next connect.
        if not isinstance(info, BackendInfo):
            log.warning("SGLang worker %s is left out of the proxy's picture of SGLang: %s", url,
                        getattr(info, "message", None) or str(info))
    picture = picture_of(client.base_url, infos)
    for disagreement in picture.disagreements:
        if not disagreement.fatal:
            log.log(disagreement.level, "%s", disagreement.line)
    fatal = [d.line for d in picture.disagreements if d.fatal]
    if fatal:
        raise FleetMismatch("; ".join(fatal))
    info = picture.agreed
    if not info.incremental_stream:
        log.warning("SGLang streams cumulatively (every event repeats the whole output): the proxy "
                    "does O(n^2) work per stream. Start SGLang with --incremental-streaming-output.")
    if not info.api.exact:
        log.warning("%s: the proxy knows SGLang %s to %s", info.api.describe(), *KNOWN_RANGE)
    return picture


async def worker_urls(view: FleetView) -> list[str]:
    """The servers that generate: the --worker flags, else those the router lists, else the backend."""
    try:
        urls = await view.list_workers(always_ask=True)
    except ProxyError:
        return [view.client.base_url]
    if urls is None:
        raise RuntimeError(f"the router at {view.client.base_url} lists no workers yet (GET /workers)")
    return urls


async def discover_one(client: SGLangClient, settings: Settings) -> BackendInfo:
    """One server's facts, from its /model_info, /server_info and /v1/models."""
    model_info = await _first_json(client, "/model_info", "/get_model_info")
    server_info = await _first_json(client, "/server_info", "/get_server_info")
    tokenizer = settings.tokenizer or model_info.get("tokenizer_path") or model_info.get("model_path")
    if not tokenizer:
        raise RuntimeError(f"SGLang at {client.base_url} reports no tokenizer_path; pass --tokenizer")
    metrics = server_info.get("enable_metrics")
    return BackendInfo(
        served_model_name=settings.served_model_name or server_info.get("served_model_name")
        or model_info.get("model_path") or "default",
        tokenizer_path=tokenizer,
        max_model_len=config_checks.max_model_len(settings.context_length, client.base_url,  # at most SGLang's
                                                  await _context_length(client, server_info, settings.context_length)),
        incremental_stream=bool(server_info.get("incremental_streaming_output")
                                or server_info.get("stream_output")),
        weight_version=model_info.get("weight_version"),
        model_path=model_info.get("model_path"),
        max_prompt_len=_max_prompt_len(server_info),
        honours_seed=bool(server_info.get("enable_deterministic_inference")),
        max_total_num_tokens=_positive_int(server_info.get("max_total_num_tokens")),
        page_size=_positive_int(server_info.get("page_size")) or 1,
        api=features_for(server_info.get("version")),
        metrics_enabled=metrics if isinstance(metrics, bool) else None,
    )


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _max_prompt_len(server_info: dict) -> int | None:
    limit = server_info.get("max_req_input_len")
    return limit - 1 if isinstance(limit, int) and limit > 1 else None


async def _context_length(client: SGLangClient, server_info: dict, fallback: int | None = None) -> int:
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
    if fallback:  # --context-length, when SGLang says none
        return fallback
    raise RuntimeError(f"cannot learn the context length from SGLang at {client.base_url}; pass --context-length")


async def _first_json(client: SGLangClient, *paths: str) -> dict:
    """Newer SGLang names first, older ones after (0.5.x keeps both)."""
    last: ProxyError | None = None
    for path in paths:
        try:
            data = await client.get_json(path)
            if isinstance(data, dict):
                return data
        except (BackendUnavailable, BackendTimeout):
            raise  # no answer at all (discover leaves out a worker that is down)
        except ProxyError as exc:
            last = exc
    raise RuntimeError(f"SGLang at {client.base_url} answered none of {paths}: "
                       f"{last.message if last else 'not an object'}")


# --- the connection's state ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Connected:
    """What connecting learned, set once and together: SGLang's picture and the tokenizer it names."""

    picture: SGLangPicture
    tokenizer_info: TokenizerInfo
    renderer: PromptRenderer
    token_texts: TokenTexts
    tool_parser: str | None  # --tool-call-parser, else the template's


@dataclass(slots=True)
class Connection:
    """The connection to SGLang: its status while connecting, what connecting learned (`connected`, one
    frozen value), and the outage edges afterwards."""

    client: SGLangClient
    settings: Settings
    executor: Executor
    busy: Callable[[], bool] = lambda: False  # requests are being served (the renderer's cache may wait)
    last_error: str | None = None  # why SGLang is not connected yet
    loading_tokenizer: str | None = None  # SGLang answered; this tokenizer is loading (a hub id may take long)
    fatal: str | None = None  # a configuration error that ends the process (an unloadable tokenizer)
    # Since when SGLang has been unreachable after it was connected (None: it is there); outage_began and
    # outage_ended log the two edges, one line each.
    outage_since: float | None = None
    connected: Connected | None = None
    # The fleet's live view (sglang/fleet_view.py): the worker list and each worker's facts; `connected.picture`
    # is its snapshot. The admin plane's fan-out lists the workers through it too.
    view: FleetView = field(init=False)
    _ready_hooks: list[Callable[[BackendInfo], None]] = field(default_factory=list)
    back_hooks: list[Callable[[], None]] = field(default_factory=list)  # run at each outage_ended edge

    def __post_init__(self) -> None:
        self.view = FleetView(self.settings, self.client)

    def when_ready(self, hook: Callable[[BackendInfo], None]) -> None:
        """Run `hook(agreed backend)` once SGLang is known (at once if it already is)."""
        if self.connected is not None:
            hook(self.connected.picture.agreed)
        else:
            self._ready_hooks.append(hook)

    def set_connected(self, connected: Connected) -> None:
        self.connected, self.last_error = connected, None
        hooks, self._ready_hooks = self._ready_hooks, []
        for hook in hooks:
            hook(connected.picture.agreed)

    def get(self) -> Connected:
        """What connecting learned, or the 503 that says why it is not known yet."""
        if self.connected is None:
            raise BackendUnavailable(self.not_ready_reason)
        return self.connected

    @property
    def not_ready_reason(self) -> str | None:
        """None when the data path can serve; else why not (what /health and every 503 say)."""
        if self.connected is not None:
            return None
        if self.fatal:
            return f"The proxy cannot serve: {self.fatal}"
        if self.loading_tokenizer:
            return (f"The proxy is loading the tokenizer {self.loading_tokenizer!r} (SGLang at "
                    f"{self.client.base_url} is up){_hub_hint(self.loading_tokenizer)}")
        why = f": {self.last_error}" if self.last_error else ""
        return f"The proxy is not connected to SGLang at {self.client.base_url} yet{why}"

    def outage_began(self, reason: str, clock=time.monotonic) -> None:
        """SGLang stopped answering after it was connected (the /metrics reader noticed): one warning."""
        if self.connected is None or self.outage_since is not None:
            return  # before the first connection the wait lines say it; during an outage it was said
        self.outage_since = clock()
        log.warning("lost SGLang: %s (requests get 503 until it answers again)", reason)

    def outage_ended(self, clock=time.monotonic) -> None:
        if self.outage_since is not None:
            log.info("SGLang at %s answers again (after %.0f s unreachable)", self.client.base_url,
                     clock() - self.outage_since)
            self.outage_since = None
            for hook in self.back_hooks:
                hook()


def _hub_hint(tokenizer: str) -> str:
    if os.path.isdir(tokenizer):
        return ""
    return (": a Hugging Face hub id, downloaded unless cached (HF_HOME); with no network, mount the model "
            "directory and pass --tokenizer DIR")


# --- connecting --------------------------------------------------------------------------------

class TokenizerLoadError(Exception):
    """The tokenizer cannot be loaded here: a configuration error, not something to wait out."""


class FleetMismatch(TokenizerLoadError):
    """The workers behind the router disagree on something no request can survive (the stream mode)."""


async def connect(conn: Connection, max_delay_s: float = 5.0, clock=time.monotonic,
                  before_load: Callable[[], None] | None = None) -> None:
    """Retry (with a capped backoff) until SGLang is healthy and discovered. Logs each wait at INFO
    until `settings.backend_wait_s` has passed, then at WARNING. An unloadable tokenizer raises.
    `before_load` runs in the loading thread once the tokenizer library is imported (_load_tokenizer)."""
    start, delay = clock(), 0.2
    while True:
        try:
            problem = await conn.client.health_problem()
            if problem is None:
                await _connect_once(conn, before_load)
                picture = conn.get().picture
                log.info("serving %s (context %d): %s", picture.agreed.served_model_name,
                         picture.agreed.max_model_len, picture.describe())
                return
            conn.last_error = f"its /health: {health_hint(problem, conn.client.base_url)}"
        except (ProxyError, RuntimeError, OSError, ValueError) as exc:
            conn.last_error = getattr(exc, "message", None) or str(exc)
        waited = clock() - start
        level = logging.WARNING if waited >= conn.settings.backend_wait_s else logging.INFO
        log.log(level, "waiting for SGLang at %s (%.0f s so far): %s", conn.client.base_url, waited,
                conn.last_error)
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


def _load_tokenizer(path: str, before_load: Callable[[], None] | None = None, chat_template: str | None = None):
    """In an executor thread. The app adopts library loggers here (`before_load`), between the import and
    the load: huggingface_hub gives itself a stderr handler on import, and its download retries would
    otherwise print twice. `chat_template` (--chat-template) replaces the tokenizer's."""
    import transformers  # noqa: F401 -- imported here so its loggers exist before they are adopted

    if before_load is not None:
        before_load()
    tokenizer = load_tokenizer(path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


async def _connect_once(conn: Connection, before_load: Callable[[], None] | None = None) -> None:
    """Discover SGLang, load the tokenizer it names, and set both on the connection."""
    picture = await discover(conn.view)
    tokenizer_path = picture.agreed.tokenizer_path
    problem = tokenizer_dir_problem(tokenizer_path) or (
        None if conn.settings.tokenizer else unseen_path_problem(tokenizer_path))
    if problem:
        raise TokenizerLoadError(problem)
    conn.loading_tokenizer = tokenizer_path
    try:
        tokenizer = await asyncio.get_running_loop().run_in_executor(conn.executor, _load_tokenizer, tokenizer_path,
                                                                     before_load, conn.settings.chat_template)
    except Exception as exc:  # noqa: BLE001 -- transformers raises OSError, ValueError, KeyError, ... for a bad tokenizer
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise TokenizerLoadError(f"cannot load the tokenizer {tokenizer_path!r}: {reason} "
                                 "(pass --tokenizer with a local directory or a Hugging Face id)") from None
    finally:
        conn.loading_tokenizer = None
    await config_checks.check_tokenizer(conn, picture, tokenizer)  # SGLang's own, or ConfigMismatch
    fast_bpe = (await asyncio.get_running_loop().run_in_executor(conn.executor, load_fast_bpe, tokenizer)
                if conn.settings.fast_encoder else None)
    agreed = picture.agreed
    renderer = PromptRenderer(tokenizer, conn.executor, conn.settings.prompt_cache_size, busy=conn.busy,
                              cache_bytes=conn.settings.prompt_cache_bytes,
                              # the longest prompt resolve_max_tokens lets through (one token of room)
                              max_prompt_ids=min(agreed.max_prompt_len or agreed.max_model_len, agreed.max_model_len - 1),
                              fast_bpe=fast_bpe)
    conn.view.learned(picture)
    conn.set_connected(Connected(conn.view.snapshot(), describe_tokenizer(tokenizer), renderer, TokenTexts(tokenizer),
                                 _tool_parser(conn.settings, tokenizer)))


def _tool_parser(settings: Settings, tokenizer) -> str | None:
    """--tool-call-parser, else the parser the tokenizer's chat template names (logged either way)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default")
    chosen = choose_tool_parser(settings.tool_call_parser, template if isinstance(template, str) else None)
    if settings.enable_auto_tool_choice and chosen is None:
        log.error("--enable-auto-tool-choice requires --tool-call-parser (the chat template names no parser): "
                  "tool_choice \"auto\" is refused until one is given")
    return chosen


# The app's connection to SGLang (the same object ProxyContext reads).
CONNECTION = web.AppKey("sglang_connection", Connection)
# Called with the message when connecting hits a configuration error (the CLI stops the server).
ON_FATAL = web.AppKey("on_fatal", Callable)


async def keep_connected(app: web.Application, before_load: Callable[[], None] | None = None) -> None:
    """The background task behind start-up: connect, or report a fatal configuration error."""
    conn = app[CONNECTION]
    try:
        await connect(conn, before_load=before_load)
        conn.back_hooks.append(config_checks.rechecker(conn, app.get(ON_FATAL)))  # SGLang restarted: compare again
    except (TokenizerLoadError, config_checks.ConfigMismatch) as exc:
        conn.fatal = conn.last_error = str(exc)
        log.error("%s", exc)
        on_fatal = app.get(ON_FATAL)
        if on_fatal is not None:
            on_fatal(str(exc))


async def wait_until_connected(app: web.Application, timeout_s: float) -> bool:
    """For tests and tools: wait (bounded) until SGLang is known; False if it is not."""
    end = time.monotonic() + timeout_s
    conn = app[CONNECTION]
    while conn.connected is None and conn.fatal is None and time.monotonic() < end:
        await asyncio.sleep(0.02)
    return conn.connected is not None
