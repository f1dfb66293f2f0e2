"""Build the simulator's aiohttp application and start it on a port."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from aiohttp import web

from token_proxy.simulator.admin_routes import add_admin_routes, empty
from token_proxy.simulator.config import SimConfig
from token_proxy.simulator.errors import SimError, json_response
from token_proxy.simulator.generate_route import generate
from token_proxy.simulator.keep_alive import KEEP_ALIVE, IdleConnections, keep_alive_close
from token_proxy.simulator.lora_routes import add_lora_routes
from token_proxy.simulator.rl_routes import add_rl_routes
from token_proxy.simulator.scheduler_block import add_scheduler_gate
from token_proxy.simulator.state import SIM_STATE, SimState
from token_proxy.simulator.tokenize_routes import add_tokenize_routes
from token_proxy.simulator.vocab import load_tokenizer, load_vocab
from token_proxy.simulator.weight_routes import add_weight_routes


class SimulatorStartError(Exception):
    """The simulator cannot start (its tokenizer does not load, its port is taken): one line."""


def create_sim_app(config: SimConfig) -> web.Application:
    app = web.Application(middlewares=[keep_alive_close, crash_gate, sglang_errors], client_max_size=256 * 1024**2)
    app[KEEP_ALIVE] = IdleConnections(config.keep_alive_s, config.keep_alive_late_s)
    path = str(config.tokenizer_path)
    try:
        vocab, tokenizer = load_vocab(path), load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 -- tokenizers raises its own Exception type for a bad file
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise SimulatorStartError(f"cannot load the tokenizer {path!r} (a directory with tokenizer.json): "
                                  f"{reason}") from None
    app[SIM_STATE] = SimState(
        config=config,
        vocab=vocab,
        tokenizer=tokenizer,
        weight_version=config.weight_version,
        weights_path=config.model_path,
    )
    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)
    add_admin_routes(app)
    add_scheduler_gate(app)
    add_weight_routes(app)
    add_rl_routes(app)
    add_lora_routes(app)
    add_tokenize_routes(app)
    return app


@web.middleware
async def crash_gate(request: web.Request, handler) -> web.StreamResponse:
    """After a simulated CUDA crash nothing answers normally again (a real server is gone)."""
    if request.app[SIM_STATE].crashed:
        return empty(503)
    return await handler(request)


@web.middleware
async def sglang_errors(request: web.Request, handler) -> web.StreamResponse:
    """Typed errors -> SGLang's bodies; aiohttp's routing misses -> FastAPI's {"detail": ...}."""
    try:
        return await handler(request)
    except SimError as error:
        return error.response()
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, 405)


async def start_simulator(
    config: SimConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Serve on the running loop; returns the runner (call `await runner.cleanup()`) and the bound port.

    handler_cancellation makes a client disconnect cancel its non-streaming
    handler, which is how an abandoned request leaves `running`.
    """
    runner = web.AppRunner(create_sim_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    return runner, _bound_port(site)


def _bound_port(site: web.TCPSite) -> int:
    server = site._server  # aiohttp does not expose the bound socket publicly
    sockets = server.sockets if server is not None else []
    return next(s.getsockname()[1] for s in sockets if s.family in (socket.AF_INET, socket.AF_INET6))


def run_simulator(config: SimConfig, host: str = "127.0.0.1", port: int = 30000, ready=None) -> None:
    """Blocking: serve until interrupted. `ready(port)` is called once listening (e.g. to print a line)."""

    async def serve() -> None:
        try:
            runner, bound = await start_simulator(config, host, port)
        except OSError as exc:
            raise SimulatorStartError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        if ready is not None:
            ready(bound)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a standalone run ends
        asyncio.run(serve())
