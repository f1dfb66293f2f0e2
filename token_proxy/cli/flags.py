"""The CLI's flag table: every flag (with its TOKEN_PROXY_* environment variable), the Settings field it
sets, its type and help, in the order --help and the README show; vLLM's other spellings, deprecated and
inverse flags, and how an unset default reads. cli.py builds the parser from it."""

from __future__ import annotations

import argparse
import json
import re

from token_proxy.checks import bool_word
from token_proxy.settings import SGLANG_PAUSE_MODES, one_of
from token_proxy.tools import REASONING_PARSERS, TOOL_PARSERS


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


def human_readable_int(value: str) -> int:
    """vllm serve's integers (vllm/utils/argparse_utils.py): 2048, 2k (2,000), 25.6k (25,600), 2K (2,048), 1M
    (1,048,576); a decimal with a binary suffix is refused in vLLM's words."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        if suffix.islower():
            return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
        if "." in number:
            raise argparse.ArgumentTypeError(f"Decimals are not allowed with binary suffixes like {suffix}. "
                                             f"Did you mean to use {number}{suffix.lower()} instead?")
        return int(number) * 2 ** (10 * "KMGT".index(suffix) + 10)
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer such as 2048, 2k, 25.6k or 2K, got {value!r}") from None


def model_len(value: str) -> int | None:
    """--max-model-len: a human-readable integer, or vLLM's -1 / auto (here: SGLang's context length)."""
    return None if value.strip() in ("-1", "auto", "AUTO") else human_readable_int(value)


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
        ("--allow-tokenizer-mismatch", "allow_tokenizer_mismatch", flag_bool, ("serve even when --tokenizer encodes "
         "a probe text to other ids than SGLang's tokenizer (a warning instead of a start-up error)")),
        ("--served-model-name", "served_model_name", several, ("the model name(s) clients send; replies carry the "
         "first")),
        ("--context-length", "context_length", model_len, ("prompt + completion limit: at most SGLang's; vLLM's forms "
         "2k, 25.6k, 2K and auto are accepted")),
        ("--chat-template", "chat_template", str, ("a chat template file (or the template itself, on one line) "
         "used instead of the tokenizer's, as vllm serve's flag")),
        ("--tokenizer-threads", "tokenizer_threads", int, "threads for chat templates and tokenization"),
        ("--prompt-cache-size", "prompt_cache_size", int, "rendered prompts kept in the LRU cache (0: off)"),
        ("--prompt-cache-bytes", "prompt_cache_bytes", int, "bytes the rendered-prompt cache may hold (0: off)"),
        ("--fast-encoder", "fast_encoder", flag_bool, ("encode ASCII prompts with tiktoken (about 4x less CPU) "
         "where start-up proves it gives the tokenizer's ids; false: the tokenizer's own encoder always")),
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
         "less CPU per token, each token up to this much later; it batches only when longer than SGLang's time "
         "per output token (4-6x it: bench/RESULTS.md section 19) (0: off; first token never held)")),
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
        ("--weight-bridge", "weight_bridges", url_list, ("bridge mode: the weight bridges (python -m "
         "token_proxy.bridge, one per inference node, comma-separated) a prime-rl or vLLM trainer's own NCCL "
         "sender pushes through, unmodified")),
        ("--fence-interval", "fence_interval_s", float, ("seconds between reads of every worker's weight "
         "version: one that restarted or differs from the fleet's is kept out until healed (0: off)")),
        ("--fleet-controller", "fleet_controller", str, ("follow the proxy at this URL, which controls the "
         "workers' weights: admin calls go there; this one never fences or heals (default: this one controls)")),
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
FLAGS = tuple(flag for _, flags in FLAG_GROUPS for flag in flags)
# Other spellings of a flag (vLLM's), accepted as the same option.
ALIASES = {
    "--disable-log-requests": ("--disable-uvicorn-access-log",),
    "--context-length": ("--max-model-len",),  # vllm serve's name
    "--workers": ("--api-server-count",),  # vllm serve's name
}
# Deprecated flags: (flag, Settings field it sets, how its value maps onto that field). Hidden from --help.
DEPRECATED = (
    ("--allow-unhonoured-seed", "require_honoured_seed", lambda allow: not allow),
)
# Flags that set a field to the opposite of their value, shown in --help: (flag, field, help).
INVERSES = (
    ("--enable-log-requests", "disable_log_requests", ("vllm serve's spelling: write the per-request access "
     "line (the default here)")),
)
# TOKEN_PROXY_* variables that are not flags but are read all the same (the test suite's golden files).
OTHER_VARIABLES = frozenset({"TOKEN_PROXY_GOLDEN_DIR"})
# What the kubelet injects into every pod of a namespace for a Service named token-proxy (or token-proxy-*):
# {SVC}_SERVICE_HOST, {SVC}_SERVICE_PORT, {SVC}_SERVICE_PORT_<PORT NAME>, {SVC}_PORT=tcp://IP:PORT and
# {SVC}_PORT_<PORT>_<TCP|UDP|SCTP>[_PROTO|_PORT|_ADDR] (kubernetes pkg/kubelet/envvars). Never flags, never typos.
_KUBERNETES_NAME = re.compile(r"TOKEN_PROXY_(?:\w+_)?(?:SERVICE_HOST|SERVICE_PORT(?:_\w+)?|PORT_\d+_(?:TCP|UDP|SCTP)"
                              r"(?:_PROTO|_PORT|_ADDR)?)")
_KUBERNETES_LINK = re.compile(r"(?:tcp|udp|sctp)://\S+")


def kubernetes_variable(name: str, value: str) -> bool:
    """A TOKEN_PROXY_* variable Kubernetes made for a Service, not one the user set for the proxy: read by
    no flag (TOKEN_PROXY_PORT=tcp://10.0.0.11:8000 is a service link, not --port)."""
    return bool(_KUBERNETES_NAME.fullmatch(name) or (name.endswith("_PORT") and _KUBERNETES_LINK.fullmatch(value)))
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
METAVARS = {int: "N", model_len: "N", float: "SECONDS", flag_bool: "BOOL", url_list: "URL", lora_module: "NAME=PATH", several: "NAME",
             listed: "LIST"}


def shown_default(field: str, value) -> str:
    if value is None or value == () or field in ("api_key", "admin_key", "sglang_api_key"):
        return UNSET_MEANS.get(field, "none")
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)
