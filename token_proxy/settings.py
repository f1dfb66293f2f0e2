"""The proxy's configuration: one frozen object, built once by the CLI (or a test)."""

from __future__ import annotations

from dataclasses import dataclass, field

# SGLang's /pause_generation modes: the values of --pause-mode (sglang/pause.py maps the admin dialects' onto them).
SGLANG_PAUSE_MODES = ("retract", "in_place", "abort")


def one_of(names) -> str:
    """`a, b or c`: the allowed values in an error or a help text."""
    return f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass(frozen=True, slots=True)
class Settings:
    # SGLang server (or sglang-router) URL; None: start the built-in simulator.
    backend_url: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    # Path or HF id; None: ask the backend's /model_info for tokenizer_path.
    tokenizer: str | None = None
    # Serve even when a probe text encodes to other ids on SGLang (sglang/config_checks.py): not SGLang's tokenizer.
    allow_tokenizer_mismatch: bool = False
    # Model name clients send and see; None: the backend's served_model_name.
    served_model_name: str | None = None
    # More names the model answers to (vllm serve --served-model-name A B C: B and C); replies say A.
    served_model_aliases: tuple[str, ...] = ()
    # vllm serve's --chat-template: a Jinja template (read from its file at start-up) used instead of the
    # tokenizer's; a request's own `chat_template` still wins.
    chat_template: str | None = None
    # None: from the backend (/v1/models max_model_len, then /server_info).
    context_length: int | None = None
    # Whole-request budget for one SGLang call (seconds).
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    # Seconds an idle connection to SGLang stays pooled: under SGLang's own keep-alive (uvicorn closes
    # idle connections after SGLANG_TIMEOUT_KEEP_ALIVE, 5 s), else a request can meet the close.
    backend_keepalive_s: float = 4.0
    # Threads that render chat templates and tokenize, off the event loop.
    tokenizer_threads: int = 2
    # Rendered-prompt LRU entries (GRPO sends each prompt many times), and the bytes they may hold.
    prompt_cache_size: int = 4096
    prompt_cache_bytes: int = 256 << 20
    # ASCII prompts encoded by a tiktoken twin of the tokenizer, where start-up proves it gives the same ids.
    fast_encoder: bool = True
    # Start-up: the port opens at once (503 until SGLang is known); after this long without SGLang
    # the wait is logged as a warning rather than info.
    backend_wait_s: float = 120.0
    # Simulator knobs, used only when backend_url is None.
    sim_ttft_ms: float = 0.0
    sim_tpot_ms: float = 0.0
    log_level: str = "info"
    # "text" or "json" for the proxy's own log lines; the per-request access line is always JSON.
    log_format: str = "text"
    # No per-request access line (vLLM's --disable-log-requests / --disable-uvicorn-access-log).
    disable_log_requests: bool = False
    # How often SGLang's /metrics is read for the vllm: view (0: never), and after how long
    # without a successful read that view is withdrawn rather than left frozen.
    backend_metrics_interval_s: float = 2.0
    backend_metrics_stale_s: float = 10.0
    # Admin plane. SGLang servers that admin calls fan out to; empty: the backend itself, or each
    # worker an sglang-router lists at /workers.
    workers: tuple[str, ...] = ()
    # SGLang pause mode behind prime-rl's /pause: "retract" keeps in-flight requests (re-queued and
    # finished after /resume) and frees their KV so the cache can be flushed; "in_place" keeps the
    # KV, so a flush fails while they wait; "abort" ends them.
    pause_mode: str = "retract"
    # Bounds on admin calls (seconds): control calls, weight loads (minutes on big models), and
    # joining a weight-update group (prime-rl's own `timeout` overrides it per call).
    admin_timeout_s: float = 300.0
    weight_update_timeout_s: float = 720.0
    init_group_timeout_s: float = 300.0
    # Bridge mode (admin/bridge_mode.py): the weight bridges (python -m token_proxy.bridge) the trainer's own NCCL
    # sender pushes through; empty: the trainer joins SGLang's group (token_proxy.broadcast).
    weight_bridges: tuple[str, ...] = ()
    # The fence (fleet/fence.py): how often every worker's /model_info weight version is read, to keep a
    # worker that restarted or drifted from the fleet's version out until it is healed (0: off); and how
    # many times a reply on weights the fleet does not serve is sent (pipeline/reply_check.py; 0: off).
    fence_interval_s: float = 0.25
    # Follow this proxy's fleet controller (fleet/ownership.py): forward the fleet's admin calls there, never
    # fence or heal, learn the fleet's version from it. None: this process controls the fleet's weights.
    fleet_controller: str | None = None
    stale_reply_tries: int = 4
    # Refuse weight / adapter paths that look local but do not exist here: SGLang would try them
    # as Hugging Face Hub ids. Turn off when the proxy does not share SGLang's filesystem.
    check_local_paths: bool = True
    # Weight and LoRA paths must lie under one of these directories (empty: anywhere); `..` and
    # symlinks leading out are refused.
    weight_dirs: tuple[str, ...] = ()
    # LoRA adapters (name, path) loaded once SGLang is up (vLLM's --lora-modules), and how often the proxy
    # checks that every worker still holds its adapters, re-loading them on one that restarted (0: never).
    lora_modules: tuple[tuple[str, str], ...] = ()
    lora_sync_interval_s: float = 5.0
    # Overload: inference requests in flight, and waiting for a slot; past both, 503 + Retry-After.
    max_concurrent_requests: int = 4096
    max_queued_requests: int = 8192
    queue_timeout_s: float = 60.0
    # Per-request time limits besides request_timeout_s (0: off): until SGLang's first stream event,
    # and between stream events (a stalled stream).
    first_token_timeout_s: float = 0.0
    stream_idle_timeout_s: float = 120.0
    # Streams: after relaying a read of SGLang's events, leave its connection unread this long, so the
    # events SGLang sends meanwhile reach the client in one write (same bytes; fewer syscalls and reads
    # per token, each token up to this much later). 0: every read as it comes.
    stream_coalesce_ms: float = 0.0
    max_body_bytes: int = 64 * 1024 * 1024  # long multi-turn prompts as token ids can be several MB
    # SIGTERM: stop accepting, then give in-flight requests this long before aborting them.
    shutdown_timeout_s: float = 30.0
    # Access. api_key guards inference routes; admin_key every weight, pause, memory and LoRA route.
    # With no admin key, admin routes answer only on loopback unless admin_open.
    api_key: str | tuple[str, ...] | None = field(default=None, repr=False)  # several: any of them
    admin_key: str | None = field(default=None, repr=False)
    admin_open: bool = False
    # CORS for browser clients (vllm serve's flags; off unless origins are given: ops/cors.py says why).
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # TLS for the proxy's own port (vllm serve's --ssl-keyfile / --ssl-certfile / --ssl-ca-certs).
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    # SGLang's own --api-key: sent as `Authorization: Bearer <key>` on every call to SGLang (never the client's).
    sglang_api_key: str | None = field(default=None, repr=False)
    # Tool calls and reasoning on the chat path (vLLM 0.33's flags). tool_call_parser: a TOOL_PARSERS
    # name; None: the one the chat template names unambiguously, if any (logged at start-up).
    # enable_auto_tool_choice: accept tool_choice "auto" (and tools without tool_choice) and parse calls.
    # exclude_tools_when_tool_choice_none: tool_choice "none" renders no tools (vLLM renders them).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    # tool_call_streaming: "fragments" streams arguments as generated (vLLM; a call cut by max_tokens
    # stays half sent); "whole" sends each call once complete (never a half call).
    tool_call_streaming: str = "fragments"
    # Session continuity (X-Session-ID / session_id): idle seconds before a session is dropped, the
    # bytes all sessions may hold (0: sessions off, keys ignored) and how many are kept (LRU).
    session_ttl_s: float = 600.0
    session_max_bytes: int = 256 << 20
    session_max_count: int = 10_000
    # SGLang ignores `seed` unless started with --enable-deterministic-inference. By default such a
    # seed is still sent and the response says it was not honoured (X-Seed-Honoured: false, a
    # counter, a rate-limited warning); this refuses it instead (400 naming `seed`).
    require_honoured_seed: bool = False

    # --- serving processes (--workers; not `workers`, the SGLang URLs above) -----------------------
    # Data-plane processes sharing the port (SO_REUSEPORT). 1: one process, exactly as before. N > 1:
    # a supervisor owns the admin plane and the vllm: view; token_proxy/serving/ says how.
    api_workers: int = 1
    # Set by the CLI (no flag) when it started the built-in simulator: said in the log and /v1/models.
    simulator: bool = False

    def __post_init__(self) -> None:
        """Each group's checks in turn; the first problem is a one-line ValueError naming the flag."""
        _check_process(self)
        _check_streams(self)
        _check_backend(self)
        _check_logs(self)
        _check_admin(self)
        _check_tool_flags(self)
        _check_sessions(self)


def _check_process(settings: Settings) -> None:
    """The process: its port, --workers, tokenizer threads, prompt cache and context length."""
    if not 0 <= settings.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {settings.port}")
    if not 1 <= settings.api_workers <= 256:
        raise ValueError(f"--workers must be in 1..256, got {settings.api_workers}")
    if settings.tokenizer_threads < 1:
        raise ValueError("--tokenizer-threads must be >= 1")
    if settings.prompt_cache_size < 0 or settings.prompt_cache_bytes < 0:
        raise ValueError("--prompt-cache-size and --prompt-cache-bytes must be >= 0 (0: no prompt cache)")
    if settings.context_length is not None and settings.context_length < 1:
        raise ValueError("--context-length must be >= 1")
    for flag, value in (("--sim-ttft-ms", settings.sim_ttft_ms), ("--sim-tpot-ms", settings.sim_tpot_ms)):
        if not value >= 0:  # NaN too
            raise ValueError(f"{flag} must be >= 0 milliseconds, got {value:g}")


def _check_streams(settings: Settings) -> None:
    """Streams: the coalescing window stays under the idle timeout."""
    if not 0 <= settings.stream_coalesce_ms <= 1000:
        raise ValueError(f"--stream-coalesce-ms must be in 0..1000 milliseconds, got {settings.stream_coalesce_ms:g}")
    if settings.stream_idle_timeout_s and settings.stream_coalesce_ms / 1000 >= settings.stream_idle_timeout_s:
        raise ValueError(f"--stream-coalesce-ms {settings.stream_coalesce_ms:g} must stay under --stream-idle-timeout "
                         f"({settings.stream_idle_timeout_s:g} s): a held read would count as SGLang's silence")


def _check_backend(settings: Settings) -> None:
    """SGLang: the wait, timeouts, keep-alive, admission limits and the URL."""
    if settings.backend_wait_s < 0:
        raise ValueError(f"--backend-wait must be >= 0 seconds, got {settings.backend_wait_s:g}")
    if settings.request_timeout_s <= 0 or settings.connect_timeout_s <= 0:
        raise ValueError("timeouts must be positive")
    if not 0 < settings.backend_keepalive_s <= 3600:
        raise ValueError(f"--backend-keepalive must be in (0, 3600] seconds and under SGLang's "
                         f"SGLANG_TIMEOUT_KEEP_ALIVE (default 5), got {settings.backend_keepalive_s:g}")
    if min(settings.max_concurrent_requests, settings.max_queued_requests, settings.max_body_bytes) < 1:
        raise ValueError("max_concurrent_requests, max_queued_requests and max_body_bytes must be >= 1")
    if settings.backend_url and not settings.backend_url.startswith(("http://", "https://")):
        raise ValueError(f"--backend must be an http(s) URL such as http://127.0.0.1:30000, "
                         f"got {settings.backend_url!r}")


def _check_logs(settings: Settings) -> None:
    """Logs and the scrape of SGLang's /metrics."""
    if settings.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ValueError(f"--log-level must be debug, info, warning or error, got {settings.log_level!r}")
    if settings.log_format not in ("text", "json"):
        raise ValueError(f"--log-format must be text or json, got {settings.log_format!r}")
    if settings.backend_metrics_interval_s < 0 or settings.backend_metrics_stale_s <= 0:
        raise ValueError("backend metrics interval must be >= 0 and staleness > 0")


def _check_admin(settings: Settings) -> None:
    """Tool-call streaming, the pause mode, admin timeouts, the fence and stale replies."""
    if settings.tool_call_streaming not in ("fragments", "whole"):
        raise ValueError(f"--tool-call-streaming must be fragments or whole, got {settings.tool_call_streaming!r}")
    if settings.pause_mode not in SGLANG_PAUSE_MODES:
        raise ValueError(f"--pause-mode must be {one_of(SGLANG_PAUSE_MODES)}, got {settings.pause_mode!r}")
    if min(settings.admin_timeout_s, settings.weight_update_timeout_s, settings.init_group_timeout_s) <= 0:
        raise ValueError("admin timeouts must be positive")
    if settings.fence_interval_s < 0 or settings.stale_reply_tries < 0:
        raise ValueError("--fence-interval and --stale-reply-tries must be >= 0 (0: off)")
    controller = settings.fleet_controller
    if controller is not None and not controller.startswith(("http://", "https://")):
        raise ValueError(f"--fleet-controller must be the controlling proxy's http(s) URL, got {controller!r}")


def _check_sessions(settings: Settings) -> None:
    if settings.session_ttl_s <= 0 or settings.session_max_bytes < 0 or settings.session_max_count < 1:
        raise ValueError("--session-ttl must be > 0, --session-max-bytes >= 0 and --session-max-count >= 1")


def _check_tool_flags(settings: Settings) -> None:
    """Parser names must be known (a one-line ValueError naming the flag). --enable-auto-tool-choice
    without --tool-call-parser is checked once the chat template is known (it may name the parser)."""
    from token_proxy.tools import check_flags

    check_flags(settings.tool_call_parser, False, settings.reasoning_parser)
