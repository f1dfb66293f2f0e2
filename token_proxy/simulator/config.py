"""The simulator's one configuration object."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# SGLang's scheduler keeps this many slots in reserve below the context length
# (max_req_len = context - 1, max_req_input_len = max_req_len - 5), which is why a
# real 4096-token server reports max_req_input_len 4090.
MAX_REQ_INPUT_RESERVE = 6
VERSION = "0.5.17"
# API generations the simulator can mimic (--sglang-version): 0.5.17 is verified against the golden
# recordings; the others follow the released source (README "SGLang versions").
VERSIONS = ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")


@dataclass(frozen=True)
class SimConfig:
    tokenizer_path: str  # a directory holding tokenizer.json
    context_length: int = 4096
    model_path: str = "sim/qwen2-tiny"
    served_model_name: str | None = None  # default: model_path, like SGLang
    ttft_s: float = 0.0  # simulated time to first token
    tpot_s: float = 0.0  # simulated time per output token
    incremental_streaming_output: bool = False  # SGLang's --incremental-streaming-output
    weight_version: str = "default"
    model_vocab_size: int = 151936  # embedding rows; an input id >= this crashes a real server
    eos_token_ids: tuple[int, ...] = (151645, 151643)
    max_running_requests: int | None = None
    enable_lora: bool = True  # SGLang's --enable-lora (/load_lora_adapter refuses without it)
    max_lora_rank: int | None = None  # --max-lora-rank (None: no limit checked)
    lora_target_modules: tuple[str, ...] | None = None  # --lora-target-modules (None: any)
    # SGLang's --enable-deterministic-inference: only then does it honour sampling_seed (its sampler
    # reads the seed only in that mode; otherwise seeded requests sample freshly, like unseeded ones).
    enable_deterministic_inference: bool = False
    # SGLang's --enable-memory-saver (without it release_memory_occupation frees nothing) and
    # --enable-weights-cpu-backup (without it released weights are discarded, not kept in CPU memory).
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    # How long a weight-update group join or receive may wait for its peers. SGLang passes no timeout, so
    # torch's default_pg_timeout (30 min) applies and no flag changes it; this knob is the simulator's own,
    # for tests that cannot wait that long.
    dist_timeout_s: float = 1800.0
    # SGLANG_HEALTH_CHECK_TIMEOUT: how long /health and /health_generate wait for the scheduler before a 503.
    health_check_timeout_s: float = field(
        default_factory=lambda: float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20")))
    # Tests of output parsing: every unconstrained sequence writes this text, then EOS (as a model
    # that answers with it; max_new_tokens still cuts it). None: the usual sampled text.
    scripted_output: str | None = None
    # The SGLang release whose API the simulator speaks (and reports as server_info `version`).
    sglang_version: str = VERSION
    # uvicorn's keep-alive in SGLang: idle connections are closed after this many seconds
    # (SGLANG_TIMEOUT_KEEP_ALIVE, 5 by default; 0: never), late by up to keep_alive_late_s, and a
    # request arriving inside that lateness is lost with the connection (keep_alive.py).
    keep_alive_s: float = field(default_factory=lambda: float(os.environ.get("SGLANG_TIMEOUT_KEEP_ALIVE", "5")))
    keep_alive_late_s: float = 0.1

    def __post_init__(self) -> None:
        if self.sglang_version not in VERSIONS:
            raise ValueError(f"sglang_version must be one of {', '.join(VERSIONS)}, got {self.sglang_version!r}")
        if self.keep_alive_s < 0 or self.keep_alive_late_s < 0:
            raise ValueError("keep_alive_s and keep_alive_late_s must be >= 0")

    def since(self, release: str) -> bool:
        """The simulated SGLang is `release` or newer (what changed in it applies)."""
        return VERSIONS.index(self.sglang_version) >= VERSIONS.index(release)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def max_req_len(self) -> int:
        return self.context_length - 1

    @property
    def max_req_input_len(self) -> int:
        return self.context_length - MAX_REQ_INPUT_RESERVE
