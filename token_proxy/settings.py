"""The proxy's configuration: one frozen object, built once by the CLI (or a test)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Settings:
    # SGLang server (or sglang-router) URL; None: start the built-in simulator.
    backend_url: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    # Path or HF id; None: ask the backend's /model_info for tokenizer_path.
    tokenizer: str | None = None
    # Model name clients send and see; None: the backend's served_model_name.
    served_model_name: str | None = None
    # None: from the backend (/v1/models max_model_len, then /server_info).
    context_length: int | None = None
    # Whole-request budget for one SGLang call (seconds).
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    # Threads that render chat templates and tokenize, off the event loop.
    tokenizer_threads: int = 2
    # Rendered-prompt LRU entries (GRPO sends each prompt many times).
    prompt_cache_size: int = 4096
    # Start-up: how long to wait for the backend's /health.
    backend_wait_s: float = 120.0
    # Simulator knobs, used only when backend_url is None.
    sim_ttft_ms: float = 0.0
    sim_tpot_ms: float = 0.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.tokenizer_threads < 1:
            raise ValueError("tokenizer_threads must be >= 1")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError("context_length must be >= 1")
        if self.request_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
