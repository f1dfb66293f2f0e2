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
import logging
import os
import sys
import urllib.parse
import urllib.request

from token_proxy import __version__
from token_proxy.cli.flags import (
    ALIASES,
    DEPRECATED,
    DESCRIPTION,
    FLAG_GROUPS,
    FLAGS,
    INVERSES,
    METAVARS,
    OTHER_VARIABLES,
    env_name,
    flag_bool,
    kubernetes_variable,
    lora_module,
    several,
    shown_default,
    url_list,
)
from token_proxy.cli.start import StartupError, bind_port, reserve_port, simulator_process
from token_proxy.settings import Settings
from token_proxy.tokenization.loader import tokenizer_dir_problem

log = logging.getLogger("token_proxy")


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
            shown = shown_default(field, getattr(defaults, field))
            # An environment value is converted in parse_settings (not by argparse, whose error would
            # blame the flag for a value the variable gave).
            default = FromEnv(environ[env]) if env in environ else getattr(defaults, field)
            listed = kind in (url_list, lora_module, several)
            repeat = {"action": "append", "default": None} if listed else {"default": default}
            if kind in (lora_module, several):
                repeat["nargs"] = "+"
            if kind is flag_bool:  # a bare `--enable-auto-tool-choice` (vLLM's spelling) means true
                repeat.update(nargs="?", const=True)
            metavar = "MS" if field.endswith("_ms") else METAVARS.get(kind, flag[2:].upper().replace("-", "_"))
            if field == "weight_dirs":
                metavar = "DIR"
            group.add_argument(flag, *ALIASES.get(flag, ()), dest=field, type=kind, metavar=metavar,
                               help=f"{help_text} [default: {shown}; env {env}]", **repeat)
    for flag, _, _ in DEPRECATED:
        parser.add_argument(flag, dest="deprecated_" + flag[2:].replace("-", "_"), type=flag_bool, nargs="?",
                            const=True, default=None, help=argparse.SUPPRESS)
    for flag, _, help_text in INVERSES:
        parser.add_argument(flag, dest="inverse_" + flag[2:].replace("-", "_"), type=flag_bool, nargs="?",
                            const=True, default=None, metavar="BOOL", help=f"{help_text} [env {env_name(flag)}]")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def known_variables() -> frozenset[str]:
    """Every TOKEN_PROXY_* variable the proxy reads: one per flag (another spelling of a flag has none)."""
    flags = [flag for flag, *_ in FLAGS] + [flag for flag, *_ in DEPRECATED] + [flag for flag, *_ in INVERSES]
    return frozenset(map(env_name, flags)) | OTHER_VARIABLES


def unknown_variable(environ) -> str | None:
    """The first TOKEN_PROXY_* variable no flag reads, as an error naming the closest known one: a typo
    (TOKEN_PROXY_BAKEND) must not quietly start the simulator."""
    known = known_variables()
    unknown = sorted(name for name in environ if name.startswith("TOKEN_PROXY_") and name not in known)
    if not unknown:
        return None
    aliases = {env_name(alias): env_name(flag) for flag, spellings in ALIASES.items() for alias in spellings}
    prefix = len("TOKEN_PROXY_")
    close = [aliases[unknown[0]]] if unknown[0] in aliases else [
        "TOKEN_PROXY_" + name for name in difflib.get_close_matches(unknown[0][prefix:], [k[prefix:] for k in known], n=1)]
    hint = f"did you mean {close[0]}?" if close else "see token-proxy --help for the variables"
    return f"unknown environment variable {unknown[0]} ({hint}; unset it to start)"


def without_kubernetes(environ) -> dict:
    """The environment less the variables Kubernetes injects for a Service named token-proxy (cli_flags says
    which): they must neither stop the proxy as unknown nor set a flag (TOKEN_PROXY_PORT=tcp://...)."""
    kept = {}
    for name, value in environ.items():
        if name.startswith("TOKEN_PROXY_") and kubernetes_variable(name, value):
            if name == env_name("--port"):
                log.info("ignoring %s=%s: Kubernetes' link to a Service named token-proxy, not a port", name, value)
            continue
        kept[name] = value
    return kept


def parse_settings(argv: list[str] | None = None, environ: dict | None = None) -> Settings:
    environ = without_kubernetes(os.environ if environ is None else environ)
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
    for flag, field, kind, _ in FLAGS:  # environment values arrive as strings
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
            except argparse.ArgumentTypeError as exc:
                parser.error(f"{env_name(flag)}: {exc}")
            except ValueError:  # int() / float()'s own message names no variable: argparse's words do
                parser.error(f"{env_name(flag)}: invalid {kind.__name__} value: {values[field].value!r}")
    if isinstance(values["served_model_name"], tuple):  # vLLM: any of them is accepted, the first is answered
        values["served_model_name"], *aliases = values["served_model_name"]
        values["served_model_aliases"] = tuple(aliases)
    _apply_vllm_api_key(values, environ)
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
    spellings = (flag, *ALIASES.get(flag, ()))
    return any(arg == s or arg.startswith(s + "=") for arg in argv for s in spellings)


def blame(message: str, argv: list[str], environ) -> str:
    """A Settings error names the flag; when the value came from its environment variable, name that."""
    for flag, *_ in FLAGS:
        if message.startswith(flag + " ") and not given_on_command_line(flag, argv) and env_name(flag) in environ:
            return f"{env_name(flag)} ({flag}){message[len(flag):]}"
    return message


def _bool_flag(args: argparse.Namespace, prefix: str, flag: str, environ) -> bool | None:
    """A hidden or other-spelling boolean flag's value: given on the command line, else its variable."""
    given = getattr(args, prefix + flag[2:].replace("-", "_"))
    env = environ.get(env_name(flag))
    return flag_bool(env) if given is None and env is not None else given


def _apply_inverses(args: argparse.Namespace, values: dict, environ) -> None:
    for flag, field, _ in INVERSES:
        given = _bool_flag(args, "inverse_", flag, environ)
        if given is not None:
            values[field] = not given


def _apply_vllm_api_key(values: dict, environ) -> None:
    """vllm serve's rule: --api-key, else VLLM_API_KEY (an empty one is none)."""
    if not values["api_key"] and environ.get("VLLM_API_KEY"):
        values["api_key"] = environ["VLLM_API_KEY"]
        log.info("inference routes require the key in VLLM_API_KEY (no --api-key or TOKEN_PROXY_API_KEY given), "
                 "as vllm serve does")


def _apply_deprecated(args: argparse.Namespace, values: dict, environ) -> None:
    for flag, field, convert in DEPRECATED:
        given = _bool_flag(args, "deprecated_", flag, environ)
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
    from token_proxy.ops.access_log import (
        configure_logging,  # here: --help and the healthcheck never load ops/
    )

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
                from token_proxy.serving.supervisor import serve_processes

                status = serve_processes(settings)
            else:
                serve(settings, sock)
                status = 0
        exit_at_once(status)  # stopped and cleaned up: no interpreter teardown past --shutdown-timeout
    except StartupError as exc:
        log.error("token-proxy cannot start: %s", exc)
        logging.shutdown()
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C before serving began (while the simulator starts): no traceback
        log.info("interrupted before the proxy started serving")
        logging.shutdown()
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
