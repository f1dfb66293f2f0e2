"""python -m token_proxy.simulator: run the SGLang simulator standalone."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys

from token_proxy.ops.access_log import configure_logging
from token_proxy.simulator.app import SimulatorStartError, run_simulator
from token_proxy.simulator.config import VERSIONS, SimConfig

log = logging.getLogger("token_proxy.simulator")
PR_SET_PDEATHSIG = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m token_proxy.simulator", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--tokenizer", default=None, help="directory with tokenizer.json (default: built-in Qwen2)"
    )
    parser.add_argument("--context-length", type=int, default=SimConfig.context_length)
    parser.add_argument("--model-path", default=SimConfig.model_path)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--ttft-ms", type=float, default=SimConfig.ttft_s * 1000)
    parser.add_argument("--tpot-ms", type=float, default=SimConfig.tpot_s * 1000)
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="honour sampling_seed (without it SGLang ignores seeds)")
    parser.add_argument("--weight-version", default=SimConfig.weight_version)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--max-running-requests", type=int, default=None)
    parser.add_argument("--dist-timeout", type=float, default=SimConfig.dist_timeout_s,
                        help="seconds a weight-update group join or receive waits for its peers (SGLang has no flag: torch's 30 min)")
    parser.add_argument("--sglang-version", default=SimConfig.sglang_version, choices=VERSIONS,
                        help="the SGLang release whose API to mimic (0.5.17 is verified against a real server)")
    parser.add_argument("--timeout-keep-alive", type=float, default=None,
                        help="seconds before an idle keep-alive connection is closed, as SGLang's uvicorn "
                             "(default: env SGLANG_TIMEOUT_KEEP_ALIVE, else 5; 0: never)")
    parser.add_argument("--keep-alive-late", type=float, default=SimConfig.keep_alive_late_s,
                        help="seconds that close may run late (a request arriving meanwhile is lost)")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process dies, even by SIGKILL (the proxy that started the built-in "
                             "simulator passes its own; Linux)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--log-format", default="text", choices=("text", "json"))
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    tokenizer = args.tokenizer
    if tokenizer is None:
        from token_proxy.simulator.builtin_tokenizer import ensure_builtin_tokenizer

        tokenizer = str(ensure_builtin_tokenizer())
    return SimConfig(
        tokenizer_path=tokenizer,
        context_length=args.context_length,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        ttft_s=args.ttft_ms / 1000,
        tpot_s=args.tpot_ms / 1000,
        incremental_streaming_output=args.incremental_streaming_output,
        enable_deterministic_inference=args.enable_deterministic_inference,
        weight_version=args.weight_version,
        enable_memory_saver=args.enable_memory_saver,
        enable_weights_cpu_backup=args.enable_weights_cpu_backup,
        max_running_requests=args.max_running_requests,
        dist_timeout_s=args.dist_timeout,
        sglang_version=args.sglang_version,
        keep_alive_late_s=args.keep_alive_late,
        **({} if args.timeout_keep_alive is None else {"keep_alive_s": args.timeout_keep_alive}),
    )


def exit_with(parent_pid: int) -> None:
    """The kernel sends this process SIGTERM when the process that started it dies, however it dies (Linux
    PR_SET_PDEATHSIG, as serving/process.py sets for serving processes; elsewhere a no-op); one already gone
    before that call is seen by the parent pid having changed."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        sys.exit(0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.parent_pid is not None:
        exit_with(args.parent_pid)
    configure_logging(args.log_level, args.log_format)
    config = config_from_args(args)
    try:
        run_simulator(config, args.host, args.port,
                      ready=lambda port: log.info("SGLang simulator ready on http://%s:%d", args.host, port))
    except SimulatorStartError as exc:
        log.error("the SGLang simulator cannot start: %s", exc)
        logging.shutdown()
        sys.exit(2)


if __name__ == "__main__":
    main()
