"""`token-proxy`: flags (with TOKEN_PROXY_* environment fallbacks) -> Settings -> the server.

Start-up order: flags are checked, the port is bound (a busy port fails here, in one line), the
simulator starts when there is no --backend, and the proxy serves at once (503 until SGLang is known).

With no --backend, the built-in SGLang simulator is started in a child process first,
so the proxy can be tried on a machine with no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

from token_proxy import __version__
from token_proxy.checks import bool_word
from token_proxy.ops.access_log import configure_logging
from token_proxy.settings import SGLANG_PAUSE_MODES, Settings, one_of
from token_proxy.tokenization.loader import tokenizer_dir_problem
from token_proxy.tools import REASONING_PARSERS, TOOL_PARSERS

log = logging.getLogger("token_proxy")


def url_list(value: str) -> tuple[str, ...]:
    """A repeatable flag's value (or its environment variable: comma-separated)."""
    return tuple(url.strip().rstrip("/") for url in value.split(",") if url.strip())


def several(value: str) -> str:
    """A flag that takes one or more values, as vllm serve's --served-model-name and --api-key (its
    environment variable: one value)."""
    return value


def listed(value: str) -> tuple[str, ...]:
    """vllm serve's list flags (--allowed-origins '["https://a.example"]'): a JSON list, or a comma list."""
    value = value.strip()
    if value.startswith("["):
        try:
            items = json.loads(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}") from None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
        return tuple(items)
    return tuple(item.strip() for item in value.split(",") if item.strip())


def flag_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    flag = bool_word(value)
    if flag is not None:
        return flag
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def lora_module(value: str) -> tuple[str, str]:
    """vLLM's --lora-modules item: `name=path`, or JSON `{"name": ..., "path": ...}`."""
    value = value.strip()
    if value.startswith("{"):
        try:
            spec = json.loads(value)
            return str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"expected {{\"name\": ..., \"path\": ...}}, got {value!r}") from exc
    name, sep, path = value.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"expected name=path, got {value!r}")
    return name, path


# (group, [(flag, Settings field, type, help)]): the order --help and the README show.
FLAG_GROUPS = (
    ("serving", (
        ("--host", "host", str, "address to listen on"),
        ("--port", "port", int, "port to listen on"),
        ("--workers", "api_workers", int, ("serving processes sharing the port (SO_REUSEPORT), like vLLM's "
         "--api-server-count; raise it when the proxy's CPU nears one core (README: Several workers)")),
        ("--tokenizer", "tokenizer", str, "tokenizer directory or Hugging Face id"),
        ("--served-model-name", "served_model_name", several, ("the model name(s) clients send; replies carry the "
         "first")),
        ("--context-length", "context_length", int, "prompt + completion limit"),
        ("--chat-template", "chat_template", str, ("a chat template file (or the template itself, on one line) "
         "used instead of the tokenizer's, as vllm serve's flag")),
        ("--tokenizer-threads", "tokenizer_threads", int, "threads for chat templates and tokenization"),
        ("--prompt-cache-size", "prompt_cache_size", int, "rendered prompts kept in the LRU cache (0: off)"),
        ("--prompt-cache-bytes", "prompt_cache_bytes", int, "bytes the rendered-prompt cache may hold (0: off)"),
        ("--shutdown-timeout", "shutdown_timeout_s", float, "seconds in-flight requests get after SIGTERM"),
    )),
    ("SGLang", (
        ("--backend", "backend_url", str, "SGLang server or sglang-router URL, e.g. http://127.0.0.1:30000"),
        ("--backend-wait", "backend_wait_s", float, ("seconds SGLang may take to come up before the wait is "
         "logged as a warning (the proxy serves 503 meanwhile)")),
        ("--request-timeout", "request_timeout_s", float, "seconds one SGLang request may take"),
        ("--connect-timeout", "connect_timeout_s", float, "seconds to open a connection to SGLang"),
        ("--backend-keepalive", "backend_keepalive_s", float, ("seconds an idle connection to SGLang is kept; "
         "keep it under SGLang's SGLANG_TIMEOUT_KEEP_ALIVE (5 s by default)")),
        ("--first-token-timeout", "first_token_timeout_s", float, ("seconds until SGLang's first stream "
         "event (0: off)")),
        ("--stream-idle-timeout", "stream_idle_timeout_s", float, "seconds a stream may stay silent (0: off)"),
        ("--stream-coalesce-ms", "stream_coalesce_ms", float, ("after relaying a stream's events, wait this "
         "long before reading SGLang's next ones, so they reach the client in one write: the same bytes for "
         "less CPU per token, each token up to this much later (0: off; first token never held)")),
        ("--require-honoured-seed", "require_honoured_seed", flag_bool, ("refuse `seed` (400) when SGLang runs "
         "without --enable-deterministic-inference and would ignore it; default: send it and report it "
         "unhonoured (X-Seed-Honoured: false)")),
    )),
    ("limits", (
        ("--max-concurrent-requests", "max_concurrent_requests", int, "inference samples in flight (a request counts its n)"),
        ("--max-queued-requests", "max_queued_requests", int, "requests waiting for a slot; more get 503"),
        ("--queue-timeout", "queue_timeout_s", float, "seconds a request may wait for a slot"),
        ("--max-body-bytes", "max_body_bytes", int, "largest request body accepted (413 beyond)"),
    )),
    ("access", (
        ("--api-key", "api_key", several, ("require Authorization: Bearer KEY (one of the keys given) on inference routes (prefer the "
         "env var)")),
        ("--admin-key", "admin_key", str, "require Bearer ADMIN_KEY on admin routes (prefer the env var)"),
        ("--admin-open", "admin_open", flag_bool, ("without an admin key, let non-loopback clients use admin "
         "routes")),
        ("--allowed-origins", "allowed_origins", listed, ("CORS: origins browsers may call from, a JSON list or "
         "comma list (\"*\": any); none: CORS off (vllm serve allows any by default)")),
        ("--allowed-methods", "allowed_methods", listed, "CORS: methods a preflight allows (\"*\": any)"),
        ("--allowed-headers", "allowed_headers", listed, "CORS: headers a preflight allows (\"*\": any)"),
        ("--allow-credentials", "allow_credentials", flag_bool, "CORS: let browsers send credentials"),
        ("--ssl-certfile", "ssl_certfile", str, "TLS on the proxy's port: the server certificate (PEM)"),
        ("--ssl-keyfile", "ssl_keyfile", str, "TLS: its private key (PEM), if not in the certificate file"),
        ("--ssl-ca-certs", "ssl_ca_certs", str, "TLS: CA bundle for client certificates (then required)"),
        ("--sglang-api-key", "sglang_api_key", str, ("SGLang's own --api-key, sent on every call to SGLang "
         "(clients' keys never are; prefer the env var)")),
    )),
    ("weights", (
        ("--worker", "workers", url_list, "repeatable: an SGLang server admin calls fan out to"),
        ("--pause-mode", "pause_mode", str, f"SGLang pause mode behind /pause: {one_of(SGLANG_PAUSE_MODES)}"),
        ("--admin-timeout", "admin_timeout_s", float, "seconds one admin call (pause, resume, ...) may take"),
        ("--weight-update-timeout", "weight_update_timeout_s", float, "seconds one weight load may take"),
        ("--init-group-timeout", "init_group_timeout_s", float, ("seconds joining a weight-update group may "
         "take")),
        ("--fence-interval", "fence_interval_s", float, ("seconds between reads of every worker's weight "
         "version: one that restarted or differs from the fleet's is kept out until healed (0: off)")),
        ("--stale-reply-tries", "stale_reply_tries", int, ("times a reply on weights the fleet does not serve "
         "is sent before a 503 (0: returned as it is)")),
        ("--check-local-paths", "check_local_paths", flag_bool, ("refuse weight/adapter paths that look local "
         "but do not exist here")),
        ("--weight-dir", "weight_dirs", url_list, ("repeatable: weight and LoRA paths must lie under one of "
         "these directories")),
        ("--lora-modules", "lora_modules", lora_module, ("LoRA adapters to load once SGLang is up: name=path "
         "... (or vLLM's JSON form); env: a comma list")),
        ("--lora-sync-interval", "lora_sync_interval_s", float, ("seconds between checks that every worker "
         "still holds the proxy's adapters (re-loaded if not; 0: off)")),
    )),
    ("tools and reasoning", (
        ("--tool-call-parser", "tool_call_parser", str, ("vLLM's tool-call parser name (" + ", ".join(
         sorted(TOOL_PARSERS)) + "); default: the one the chat template names, if unambiguous")),
        ("--enable-auto-tool-choice", "enable_auto_tool_choice", flag_bool, ("accept tool_choice \"auto\" (and "
         "tools without tool_choice) and parse the model's tool calls, as vLLM")),
        ("--reasoning-parser", "reasoning_parser", str, ("split thinking into `reasoning` (" + ", ".join(
         sorted(REASONING_PARSERS)) + ")")),
        ("--exclude-tools-when-tool-choice-none", "exclude_tools_when_tool_choice_none", flag_bool,
         "tool_choice \"none\" renders no tools into the prompt (vLLM's default renders them)"),
        ("--tool-call-streaming", "tool_call_streaming", str, ("fragments (vLLM: arguments stream as generated; "
         "a call cut by max_tokens stays half sent) or whole (each call sent once complete)")),
    )),
    ("sessions", (
        ("--session-ttl", "session_ttl_s", float, "idle seconds before a chat session (X-Session-ID) is dropped"),
        ("--session-max-bytes", "session_max_bytes", int, "bytes all chat sessions may hold (0: sessions off)"),
        ("--session-max-count", "session_max_count", int, "chat sessions kept (least recently used dropped)"),
    )),
    ("logging and metrics", (
        ("--log-level", "log_level", str, "debug, info, warning or error"),
        ("--log-format", "log_format", str, "text or json (the per-request access line is always JSON)"),
        ("--disable-log-requests", "disable_log_requests", flag_bool, ("no per-request access line (vLLM "
         "0.6-0.10's spelling; --disable-uvicorn-access-log is accepted too)")),
        ("--backend-metrics-interval", "backend_metrics_interval_s", float, ("seconds between reads of "
         "SGLang's /metrics for the vllm: view (0: off)")),
        ("--backend-metrics-stale-after", "backend_metrics_stale_s", float, ("seconds without a good read of "
         "SGLang's /metrics before the vllm: view is withdrawn")),
    )),
    ("simulator (only without --backend)", (
        ("--sim-ttft-ms", "sim_ttft_ms", float, "time to first token"),
        ("--sim-tpot-ms", "sim_tpot_ms", float, "time per output token"),
    )),
)
_FLAGS = tuple(flag for _, flags in FLAG_GROUPS for flag in flags)
# Other spellings of a flag (vLLM's), accepted as the same option.
_ALIASES = {
    "--disable-log-requests": ("--disable-uvicorn-access-log",),
    "--context-length": ("--max-model-len",),  # vllm serve's name
    "--workers": ("--api-server-count",),  # vllm serve's name
}
# Deprecated flags: (flag, Settings field it sets, how its value maps onto that field). Hidden from --help.
_DEPRECATED = (
    ("--allow-unhonoured-seed", "require_honoured_seed", lambda allow: not allow),
)
# Flags that set a field to the opposite of their value, shown in --help: (flag, field, help).
_INVERSES = (
    ("--enable-log-requests", "disable_log_requests", ("vllm serve's spelling: write the per-request access "
     "line (the default here)")),
)
# TOKEN_PROXY_* variables that are not flags but are read all the same (the test suite's golden files).
OTHER_VARIABLES = frozenset({"TOKEN_PROXY_GOLDEN_DIR"})
DESCRIPTION = ("An OpenAI/vLLM-compatible proxy in front of SGLang's native /generate. With no --backend, "
               "the built-in SGLang simulator runs in a child process (no GPU needed). Every flag also "
               "reads an environment variable, TOKEN_PROXY_<FLAG> (e.g. TOKEN_PROXY_BACKEND).")


def env_name(flag: str) -> str:
    return "TOKEN_PROXY_" + flag[2:].upper().replace("-", "_")


# What an unset (None / empty) default means, as --help and the README say it.
UNSET_MEANS = {
    "tokenizer": "SGLang's tokenizer_path", "served_model_name": "SGLang's", "context_length": "SGLang's", "chat_template": "the tokenizer's",
    "backend_url": "the built-in simulator", "workers": "the backend, or the router's workers",
    "weight_dirs": "anywhere", "lora_modules": "none", "api_key": "none", "admin_key": "none",
    "sglang_api_key": "none",
    "tool_call_parser": "the one the chat template names", "reasoning_parser": "none",
}
_METAVARS = {int: "N", float: "SECONDS", flag_bool: "BOOL", url_list: "URL", lora_module: "NAME=PATH", several: "NAME",
             listed: "LIST"}


def _shown_default(field: str, value) -> str:
    if value is None or value == () or field in ("api_key", "admin_key", "sglang_api_key"):
        return UNSET_MEANS.get(field, "none")
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


class OneLineParser(argparse.ArgumentParser):
    """A flag error is one line naming the flag and --help (not the 30-line usage first), written as a
    JSON log line when the log format is JSON (json_errors), so a log pipeline can read it."""

    json_errors = False

    def error(self, message: str):
        line = f"{self.prog}: error: {message} (see {self.prog} --help)"
        if self.json_errors:
            from token_proxy.ops.access_log import JsonFormatter

            record = logging.LogRecord("token_proxy", logging.ERROR, __file__, 0, line, None, None)
            line = JsonFormatter().format(record)
        self.exit(2, line + "\n")


def wants_json_log(argv: list[str], environ) -> bool:
    """--log-format json as the parser would read it (the last one wins), before parsing succeeds."""
    fmt = environ.get(env_name("--log-format"), "text")
    for i, arg in enumerate(argv):
        if arg == "--log-format" and i + 1 < len(argv):
            fmt = argv[i + 1]
        elif arg.startswith("--log-format="):
            fmt = arg.partition("=")[2]
    return fmt == "json"


@dataclasses.dataclass(frozen=True, slots=True)
class FromEnv:
    """A flag's value read from its TOKEN_PROXY_* variable, still a string."""

    value: str


def build_parser(environ: dict) -> argparse.ArgumentParser:
    defaults = Settings()
    parser = OneLineParser(prog="token-proxy", description=DESCRIPTION)
    for title, flags in FLAG_GROUPS:
        group = parser.add_argument_group(title)
        for flag, field, kind, help_text in flags:
            env = env_name(flag)
            shown = _shown_default(field, getattr(defaults, field))
            # An environment value is converted in parse_settings (not by argparse, whose error would
            # blame the flag for a value the variable gave).
            default = FromEnv(environ[env]) if env in environ else getattr(defaults, field)
            listed = kind in (url_list, lora_module, several)
            repeat = {"action": "append", "default": None} if listed else {"default": default}
            if kind in (lora_module, several):
                repeat["nargs"] = "+"
            if kind is flag_bool:  # a bare `--enable-auto-tool-choice` (vLLM's spelling) means true
                repeat.update(nargs="?", const=True)
            metavar = "MS" if field.endswith("_ms") else _METAVARS.get(kind, flag[2:].upper().replace("-", "_"))
            if field == "weight_dirs":
                metavar = "DIR"
            group.add_argument(flag, *_ALIASES.get(flag, ()), dest=field, type=kind, metavar=metavar,
                               help=f"{help_text} [default: {shown}; env {env}]", **repeat)
    for flag, _, _ in _DEPRECATED:
        parser.add_argument(flag, dest="deprecated_" + flag[2:].replace("-", "_"), type=flag_bool, nargs="?",
                            const=True, default=None, help=argparse.SUPPRESS)
    for flag, _, help_text in _INVERSES:
        parser.add_argument(flag, dest="inverse_" + flag[2:].replace("-", "_"), type=flag_bool, nargs="?",
                            const=True, default=None, metavar="BOOL", help=f"{help_text} [env {env_name(flag)}]")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def known_variables() -> frozenset[str]:
    """Every TOKEN_PROXY_* variable the proxy reads: one per flag (another spelling of a flag has none)."""
    flags = [flag for flag, *_ in _FLAGS] + [flag for flag, *_ in _DEPRECATED] + [flag for flag, *_ in _INVERSES]
    return frozenset(map(env_name, flags)) | OTHER_VARIABLES


def unknown_variable(environ) -> str | None:
    """The first TOKEN_PROXY_* variable no flag reads, as an error naming the closest known one: a typo
    (TOKEN_PROXY_BAKEND) must not quietly start the simulator."""
    known = known_variables()
    unknown = sorted(name for name in environ if name.startswith("TOKEN_PROXY_") and name not in known)
    if not unknown:
        return None
    aliases = {env_name(alias): env_name(flag) for flag, spellings in _ALIASES.items() for alias in spellings}
    prefix = len("TOKEN_PROXY_")
    close = [aliases[unknown[0]]] if unknown[0] in aliases else [
        "TOKEN_PROXY_" + name for name in difflib.get_close_matches(unknown[0][prefix:], [k[prefix:] for k in known], n=1)]
    hint = f"did you mean {close[0]}?" if close else "see token-proxy --help for the variables"
    return f"unknown environment variable {unknown[0]} ({hint}; unset it to start)"


def parse_settings(argv: list[str] | None = None, environ: dict | None = None) -> Settings:
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    parser.json_errors = wants_json_log(sys.argv[1:] if argv is None else argv, environ)
    unknown = unknown_variable(environ)
    if unknown:
        parser.error(unknown)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings) if hasattr(args, f.name)}
    _apply_deprecated(args, values, environ)
    _apply_inverses(args, values, environ)
    for flag, field, kind, _ in _FLAGS:  # environment values arrive as strings
        if kind is url_list:  # repeatable: the flags given, else the environment's comma list
            given = values[field]
            values[field] = tuple(u for urls in given for u in urls) if given else url_list(
                environ.get(env_name(flag), ""))
        elif kind is lora_module:  # --lora-modules a=x b=y [--lora-modules c=z], else the env's comma list
            given = values[field]
            try:
                values[field] = tuple(m for mods in given for m in mods) if given else tuple(
                    lora_module(item) for item in environ.get(env_name(flag), "").split(",") if item.strip())
            except argparse.ArgumentTypeError as exc:
                parser.error(f"{env_name(flag)}: {exc}")
        elif kind is several:  # one or more values on the command line, else the environment's one
            given = [name for names in values[field] or () for name in names] or (
                [environ[env_name(flag)]] if environ.get(env_name(flag)) else [])
            values[field] = given[0] if len(given) == 1 else tuple(given) or None
        elif isinstance(values[field], FromEnv):
            try:
                values[field] = kind(values[field].value)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{env_name(flag)}: {exc}")
    if isinstance(values["served_model_name"], tuple):  # vLLM: any of them is accepted, the first is answered
        values["served_model_name"], *aliases = values["served_model_name"]
        values["served_model_aliases"] = tuple(aliases)
    values["backend_url"] = values["backend_url"] or None  # TOKEN_PROXY_BACKEND="": the simulator
    if values["backend_url"]:
        try:
            values["backend_url"], warning = normalise_backend_url(values["backend_url"])
        except ValueError as exc:
            parser.error(str(exc))
        if warning:
            log.warning("%s", warning)
    try:
        return Settings(**values)
    except ValueError as exc:
        parser.error(blame(str(exc), argv, environ))


def given_on_command_line(flag: str, argv: list[str]) -> bool:
    spellings = (flag, *_ALIASES.get(flag, ()))
    return any(arg == s or arg.startswith(s + "=") for arg in argv for s in spellings)


def blame(message: str, argv: list[str], environ) -> str:
    """A Settings error names the flag; when the value came from its environment variable, name that."""
    for flag, *_ in _FLAGS:
        if message.startswith(flag + " ") and not given_on_command_line(flag, argv) and env_name(flag) in environ:
            return f"{env_name(flag)} ({flag}){message[len(flag):]}"
    return message


def _apply_inverses(args: argparse.Namespace, values: dict, environ) -> None:
    for flag, field, _ in _INVERSES:
        given = getattr(args, "inverse_" + flag[2:].replace("-", "_"))
        env = environ.get(env_name(flag))
        if given is None and env is not None:
            given = flag_bool(env)
        if given is not None:
            values[field] = not given


def _apply_deprecated(args: argparse.Namespace, values: dict, environ) -> None:
    for flag, field, convert in _DEPRECATED:
        given = getattr(args, "deprecated_" + flag[2:].replace("-", "_"))
        env = environ.get(env_name(flag))
        if given is None and env is not None:
            given = flag_bool(env)
        if given is not None:
            values[field] = convert(given)
            log.warning("%s is deprecated; it sets %s", flag, field)


# SGLang's own routes: a --backend ending in one names a route, not the server (the proxy adds them).
SGLANG_ROUTES = ("/generate", "/health", "/health_generate", "/model_info", "/get_model_info", "/server_info",
                 "/get_server_info", "/metrics", "/v1/chat/completions", "/v1/completions", "/v1/models")


def normalise_backend_url(url: str) -> tuple[str, str | None]:
    """SGLang's base URL, or ValueError. An OpenAI-style .../v1 suffix is dropped, with a warning:
    the proxy calls SGLang's native routes (/generate, /model_info) at its root. A path ending in one
    of those routes is refused; an http URL with no port is used (port 80: a reverse proxy may be
    there) with a warning naming SGLang's own port, 30000."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
    except ValueError as exc:  # "Invalid IPv6 URL": an unclosed [
        raise ValueError(f"--backend {url!r} is not a valid URL ({exc}): write it as http://HOST:PORT, "
                         "an IPv6 host in brackets (http://[::1]:30000)") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--backend {url!r} is not an http(s) URL: write it as http://HOST:PORT "
                         "(SGLang's address, without /v1)")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"--backend {url!r} has an invalid port: write it as http://HOST:PORT") from None
    path = parts.path.rstrip("/")
    root = f"{parts.scheme}://{parts.netloc}"
    route = next((r for r in SGLANG_ROUTES if path.endswith(r)), None)
    if route:
        raise ValueError(f"--backend {url!r} names SGLang's {route} route, not the server: pass its root, "
                         f"--backend {root}{path[:-len(route)]}")
    warning = None
    if path.endswith("/v1"):
        path = path[:-3]
        warning = (f"--backend {url!r} ends in /v1 (an OpenAI base URL); using SGLang's root "
                   f"{root}{path} (the proxy calls its native /generate)")
    elif port is None:
        default = 80 if parts.scheme == "http" else 443
        warning = (f"--backend {url!r} names no port: using port {default} (SGLang listens on 30000 unless "
                   f"started with --port; write {root}:30000{path} if that is where it is)")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", "")), warning


def looks_local(path: str) -> bool:
    """A path, not a Hugging Face id (ids are `name` or `org/name`)."""
    return path.startswith(("/", "./", "../", "~")) or path in (".", "..") or os.path.exists(path)


def check_tokenizer_path(path: str | None) -> None:
    """A local tokenizer path that does not exist is a typo, not a hub id to wait for; a directory with
    no tokenizer in it is the wrong directory."""
    if path and looks_local(path) and not os.path.exists(os.path.expanduser(path)):
        raise StartupError(f"--tokenizer {path!r}: no such file or directory")
    problem = path and tokenizer_dir_problem(path)
    if problem:
        raise StartupError(problem)


def check_tls(settings: Settings) -> None:
    """--ssl-* files that make no TLS context stop start-up here, in one line."""
    from token_proxy.serving.tls import server_ssl_context

    try:
        server_ssl_context(settings)
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it is a template (vLLM reads it the same way:
    a path if one exists, else the template). A value that looks like a path but names no file is a typo."""
    if not value:
        return None
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as file:
            return file.read()
    if "{" not in value and looks_local(value):
        raise StartupError(f"--chat-template {value!r}: no such file (give a template file, or the template itself)")
    return value


class StartupError(Exception):
    """A configuration problem found before serving: one line, exit status 2."""


class _Held(logging.Handler):
    """Records logged while the flags are read (a --backend warning), before logging is configured:
    written afterwards, in the configured format."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def main(argv: list[str] | None = None) -> None:
    held, root = _Held(), logging.getLogger()
    root.addHandler(held)
    try:
        settings = parse_settings(argv)
    finally:
        root.removeHandler(held)
    configure_logging(settings.log_level, settings.log_format, access_lines=not settings.disable_log_requests)
    for record in held.records:
        root.handle(record)
    try:
        check_tokenizer_path(settings.tokenizer)
        settings = dataclasses.replace(settings, chat_template=read_chat_template(settings.chat_template))
        check_tls(settings)
        # Before anything starts: a busy port fails first. With --workers N the workers bind it
        # (SO_REUSEPORT); this socket only claims it (and resolves port 0) meanwhile.
        several = settings.api_workers > 1
        sock = reserve_port(settings.host, settings.port) if several else bind_port(settings.host, settings.port)
        settings = dataclasses.replace(settings, port=sock.getsockname()[1])
        with sock, contextlib.ExitStack() as stack:
            if not settings.backend_url:
                url = stack.enter_context(simulator_process(settings))
                settings = dataclasses.replace(settings, backend_url=url, simulator=True)
            from token_proxy.serving.serve import exit_at_once, serve

            if several:
                from token_proxy.serving.supervisor import serve_workers

                status = serve_workers(settings)
            else:
                serve(settings, sock)
                status = 0
        exit_at_once(status)  # stopped and cleaned up: no interpreter teardown past --shutdown-timeout
    except StartupError as exc:
        log.error("token-proxy cannot start: %s", exc)
        logging.shutdown()
        raise SystemExit(2) from None


def bind_port(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(1024)
    sock.set_inheritable(False)
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """--workers N: the port claimed but never listened on (this socket gets no connections); a busy
    port fails here, once, before any worker starts. Bound *without* SO_REUSEPORT, so the bind fails
    if anything holds the port, another --workers proxy included; SO_REUSEPORT is set after the bind
    so that this proxy's workers (same user) can join it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(False)
    return sock


@contextlib.contextmanager
def simulator_process(settings: Settings):
    """The built-in simulator on a free loopback port, in a child process so it never shares the
    proxy's event loop."""
    port = _free_port()
    # Configured as the README recommends for SGLang itself: deltas in streams, seeds honoured.
    cmd = [sys.executable, "-m", "token_proxy.simulator", "--host", "127.0.0.1", "--port", str(port),
           "--ttft-ms", str(settings.sim_ttft_ms), "--tpot-ms", str(settings.sim_tpot_ms),
           "--incremental-streaming-output", "--enable-deterministic-inference",
           "--log-level", settings.log_level, "--log-format", settings.log_format]
    if settings.context_length:
        cmd += ["--context-length", str(settings.context_length)]
    if settings.tokenizer:
        cmd += ["--tokenizer", settings.tokenizer]
    log.warning("no --backend given: starting the built-in SGLang simulator on 127.0.0.1:%d. ITS TOKENS COME FROM "
                "NO MODEL: never train on them (pass --backend http://HOST:30000 for SGLang)", port)
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
            raise StartupError(f"the built-in simulator exited with status {proc.returncode} (see its line above)")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise StartupError(f"the simulator at {url} did not become healthy in {deadline_s:.0f} s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
