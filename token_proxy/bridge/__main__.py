"""`python -m token_proxy.bridge --sglang URL[,URL]`: the weight bridge on one inference node.

Run it beside the SGLang workers of this node, in an environment whose torch (hence NCCL) is the trainer's
(`pip install 'sglang-token-proxy[bridge]' torch==<the trainer's>`); start the proxy with
`--weight-bridge http://<this host>:<port>`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from token_proxy.bridge.server import BridgeSettings, create_bridge_app


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.startswith("NCCL_"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NCCL_NAME=VALUE")
    return key, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m token_proxy.bridge", description=__doc__.splitlines()[0])
    p.add_argument("--sglang", required=True,
                   help="the SGLang workers on this node, comma-separated URLs, in the proxy's worker order")
    p.add_argument("--host", default="127.0.0.1", help="the address the proxy reaches the bridge on")
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--nccl-env", type=_env_pair, action="append", default=[], metavar="NCCL_NAME=VALUE",
                   help="an NCCL variable the trainer sets (its receivers get it); repeatable. Without it the "
                        "receivers run NCCL's defaults, as a stock vLLM 0.33 or prime-rl trainer does")
    p.add_argument("--load-timeout", type=float, default=BridgeSettings.load_timeout_s,
                   help="seconds one bucket's load into SGLang may take")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workers = tuple(u.strip().rstrip("/") for u in args.sglang.split(",") if u.strip())
    if not workers:
        sys.exit("--sglang: give at least one SGLang URL, e.g. --sglang http://127.0.0.1:30000")
    try:
        import torch  # noqa: F401 - the receivers need it; say so at start, not at the trainer's first init
    except ImportError:
        sys.exit("the bridge needs torch: pip install 'sglang-token-proxy[bridge]' with the trainer's torch version")
    settings = BridgeSettings(workers, tuple(args.nccl_env), args.load_timeout)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    web.run_app(create_bridge_app(settings), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
