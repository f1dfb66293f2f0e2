"""`token-proxy`: flags (with TOKEN_PROXY_* environment fallbacks) -> Settings -> the server.

With no --backend, the built-in SGLang simulator is started in a child process first,
so the proxy can be tried on a machine with no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request

from token_proxy.proxy.ops.access_log import configure_logging
from token_proxy.settings import Settings
from token_proxy.tools import REASONING_PARSERS, TOOL_PARSERS

log = logging.getLogger("token_proxy")


def url_list(value: str) -> tuple[str, ...]:
    """A repeatable flag's value (or its environment variable: comma-separated)."""
    return tuple(url.strip().rstrip("/") for url in value.split(",") if url.strip())


def flag_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


# flag -> (Settings field, type, help)
_FLAGS = (
    ("--backend", "backend_url", str, "SGLang server or sglang-router URL; omit to run the built-in simulator"),
    ("--host", "host", str, "address to listen on"),
    ("--port", "port", int, "port to listen on"),
    ("--tokenizer", "tokenizer", str, "tokenizer path or HF id (default: SGLang's tokenizer_path)"),
    ("--served-model-name", "served_model_name", str, "model name (default: SGLang's)"),
    ("--context-length", "context_length", int, "context length (default: SGLang's max_model_len)"),
    ("--request-timeout", "request_timeout_s", float, "seconds one SGLang request may take"),
    ("--connect-timeout", "connect_timeout_s", float, "seconds to connect to SGLang"),
    ("--tokenizer-threads", "tokenizer_threads", int, "threads for chat templates and tokenization"),
    ("--prompt-cache-size", "prompt_cache_size", int, "rendered prompts kept in the LRU cache (0: off)"),
    ("--backend-wait", "backend_wait_s", float, "seconds to wait for SGLang's /health at start-up"),
    ("--sim-ttft-ms", "sim_ttft_ms", float, "simulator only: time to first token"),
    ("--sim-tpot-ms", "sim_tpot_ms", float, "simulator only: time per output token"),
    ("--log-level", "log_level", str, "debug, info, warning or error"),
    ("--log-format", "log_format", str, "text or json (the per-request access line is always JSON)"),
    ("--backend-metrics-interval", "backend_metrics_interval_s", float,
     "seconds between reads of SGLang's /metrics for the vllm: view (0: off)"),
    ("--backend-metrics-stale-after", "backend_metrics_stale_s", float,
     "seconds without a good read of SGLang's /metrics before the vllm: view is withdrawn"),
    ("--worker", "workers", url_list,
     "repeatable: an SGLang server admin calls fan out to (default: the backend, or the router's workers)"),
    ("--pause-mode", "pause_mode", str, "SGLang pause mode behind /pause: retract, in_place or abort"),
    ("--admin-timeout", "admin_timeout_s", float, "seconds one admin call (pause, resume, ...) may take"),
    ("--weight-update-timeout", "weight_update_timeout_s", float, "seconds one weight load may take"),
    ("--init-group-timeout", "init_group_timeout_s", float, "seconds joining a weight-update group may take"),
    ("--check-local-paths", "check_local_paths", flag_bool,
     "refuse weight/adapter paths that look local but do not exist here (true/false)"),
    ("--weight-dir", "weight_dirs", url_list,
     "repeatable: weight and LoRA paths must lie under one of these directories"),
    ("--max-concurrent-requests", "max_concurrent_requests", int, "inference requests in flight"),
    ("--max-queued-requests", "max_queued_requests", int, "requests waiting for a slot; more get 503"),
    ("--queue-timeout", "queue_timeout_s", float, "seconds a request may wait for a slot"),
    ("--first-token-timeout", "first_token_timeout_s", float, "seconds until SGLang's first event (0: off)"),
    ("--stream-idle-timeout", "stream_idle_timeout_s", float, "seconds a stream may stay silent (0: off)"),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body accepted (413 beyond)"),
    ("--shutdown-timeout", "shutdown_timeout_s", float, "seconds in-flight requests get after SIGTERM"),
    ("--api-key", "api_key", str, "require Authorization: Bearer KEY on inference routes (prefer the env var)"),
    ("--admin-key", "admin_key", str, "require Bearer ADMIN_KEY on admin routes (prefer the env var)"),
    ("--admin-open", "admin_open", flag_bool, "without an admin key, let non-loopback clients use admin routes"),
    ("--tool-call-parser", "tool_call_parser", str,
     "vLLM's tool-call parser name (" + ", ".join(sorted(TOOL_PARSERS)) + "); default: the one the chat "
     "template names, if unambiguous"),
    ("--enable-auto-tool-choice", "enable_auto_tool_choice", flag_bool,
     "accept tool_choice \"auto\" (and tools without tool_choice) and parse the model's tool calls, as vLLM"),
    ("--reasoning-parser", "reasoning_parser", str,
     "split thinking into `reasoning` (" + ", ".join(sorted(REASONING_PARSERS)) + ")"),
    ("--exclude-tools-when-tool-choice-none", "exclude_tools_when_tool_choice_none", flag_bool,
     "tool_choice \"none\" renders no tools into the prompt (vLLM's default renders them)"),
    ("--session-ttl", "session_ttl_s", float, "idle seconds before a chat session (X-Session-ID) is dropped"),
    ("--session-max-bytes", "session_max_bytes", int, "bytes all chat sessions may hold (0: sessions off)"),
    ("--session-max-count", "session_max_count", int, "chat sessions kept (least recently used dropped)"),
    ("--require-honoured-seed", "require_honoured_seed", flag_bool,
     ("refuse `seed` (400) when SGLang runs without --enable-deterministic-inference and would ignore it; "
      "default: send it and report it unhonoured (X-Seed-Honoured: false)")),
)
# Deprecated flags: (flag, Settings field it sets, how its value maps onto that field).
_DEPRECATED = (
    ("--allow-unhonoured-seed", "require_honoured_seed", lambda allow: not allow),
)


def parse_settings(argv: list[str] | None = None, environ: dict | None = None) -> Settings:
    environ = os.environ if environ is None else environ
    defaults = Settings()
    parser = argparse.ArgumentParser(prog="token-proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, field, kind, help_text in _FLAGS:
        env = "TOKEN_PROXY_" + flag[2:].upper().replace("-", "_")
        default = environ.get(env, getattr(defaults, field))
        repeat = {"action": "append", "default": None} if kind is url_list else {"default": default}
        if kind is flag_bool:  # a bare `--enable-auto-tool-choice` (vLLM's spelling) means true
            repeat.update(nargs="?", const=True)
        parser.add_argument(flag, dest=field, type=kind, **repeat,
                            help=f"{help_text} [env {env}; default {getattr(defaults, field)}]")
    for flag, _, _ in _DEPRECATED:
        parser.add_argument(flag, dest="deprecated_" + flag[2:].replace("-", "_"), type=flag_bool, nargs="?",
                            const=True, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings) if hasattr(args, f.name)}
    _apply_deprecated(args, values, environ)
    for flag, field, kind, _ in _FLAGS:  # environment values arrive as strings
        if kind is url_list:  # repeatable: the flags given, else the environment's comma list
            given = values[field]
            env_value = environ.get("TOKEN_PROXY_" + flag[2:].upper().replace("-", "_"), "")
            values[field] = tuple(u for urls in given for u in urls) if given else url_list(env_value)
        elif isinstance(values[field], str) and kind is not str:
            values[field] = kind(values[field])
    try:
        return Settings(**values)
    except ValueError as exc:
        parser.error(str(exc))


def _apply_deprecated(args: argparse.Namespace, values: dict, environ) -> None:
    for flag, field, convert in _DEPRECATED:
        given = getattr(args, "deprecated_" + flag[2:].replace("-", "_"))
        env = environ.get("TOKEN_PROXY_" + flag[2:].upper().replace("-", "_"))
        if given is None and env is not None:
            given = flag_bool(env)
        if given is not None:
            values[field] = convert(given)
            log.warning("%s is deprecated; it sets %s", flag, field)


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    configure_logging(settings.log_level, settings.log_format)
    with contextlib.ExitStack() as stack:
        if not settings.backend_url:
            url = stack.enter_context(simulator_process(settings))
            settings = dataclasses.replace(settings, backend_url=url)
        serve(settings)


def serve(settings: Settings) -> None:
    from aiohttp import web

    from token_proxy.proxy.app import create_app

    # Every stream event allocates a few short-lived dicts; the default gen-0 threshold (700) would run
    # the collector thousands of times a second under load. Long-lived objects are frozen out of it.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    log.info("token-proxy listening on http://%s:%d/v1 -> %s", settings.host, settings.port, settings.backend_url)
    web.run_app(create_app(settings), host=settings.host, port=settings.port, handler_cancellation=True,
                shutdown_timeout=settings.shutdown_timeout_s,
                access_log=None, print=None)


@contextlib.contextmanager
def simulator_process(settings: Settings):
    """The built-in simulator on a free loopback port, in a child process so it never shares the
    proxy's event loop."""
    port = _free_port()
    # Configured as the README recommends for SGLang itself: deltas in streams, seeds honoured.
    cmd = [sys.executable, "-m", "token_proxy.simulator", "--host", "127.0.0.1", "--port", str(port),
           "--ttft-ms", str(settings.sim_ttft_ms), "--tpot-ms", str(settings.sim_tpot_ms),
           "--incremental-streaming-output", "--enable-deterministic-inference"]
    if settings.context_length:
        cmd += ["--context-length", str(settings.context_length)]
    if settings.tokenizer:
        cmd += ["--tokenizer", settings.tokenizer]
    log.info("no --backend given: starting the built-in SGLang simulator on 127.0.0.1:%d", port)
    proc = subprocess.Popen(cmd)
    try:
        _wait_for_health(f"http://127.0.0.1:{port}", proc, deadline_s=180.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_for_health(url: str, proc: subprocess.Popen, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the simulator exited with status {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"the simulator at {url} did not become healthy in {deadline_s:.0f} s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
