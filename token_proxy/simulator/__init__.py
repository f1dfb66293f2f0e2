"""A fast, deterministic stand-in for SGLang 0.5.17's native HTTP API (/generate and the admin routes).

    app = create_sim_app(SimConfig(tokenizer_path=...))          # for aiohttp_client or your own runner
    runner, port = await start_simulator(config, "127.0.0.1", 0)  # serve on the running loop
    run_simulator(config, host, port)                             # blocking, e.g. in a thread
    python -m token_proxy.simulator --port 30000                  # standalone
"""

from token_proxy.simulator.app import create_sim_app, run_simulator, start_simulator
from token_proxy.simulator.config import SimConfig
from token_proxy.simulator.state import SIM_STATE, SimState

__all__ = ["SIM_STATE", "SimConfig", "SimState", "create_sim_app", "run_simulator", "start_simulator"]
