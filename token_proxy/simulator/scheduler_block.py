"""A scheduler blocked inside a call, as SGLang 0.5.17's is while it joins a weight-update group.

SGLang runs /init_weights_update_group on its scheduler's thread (scheduler_components/weight_updater.py →
tp_worker.py → model_runner_components/weight_updater.py → utils/common.py's init_custom_process_group, which
passes no timeout: torch's default_pg_timeout, 30 minutes; SGLang has no flag for it). Until the rendezvous
completes or that timeout ends it (SGLang then answers 400 "Failed to initialize custom process group: <torch's
error>."), the scheduler takes nothing else (../shared/golden/extra_run3_init_group_hang.json):
- /generate (and the OpenAI routes) wait: nothing is admitted, nothing running makes a token;
- /health and /health_generate wait for the scheduler up to SGLANG_HEALTH_CHECK_TIMEOUT (20 s), then 503;
- every other call that needs the scheduler (pause, continue, flush, weight updates, a destroy, server_info,
  get_load, ...) waits its turn;
- what the tokenizer process answers alone does not wait: /model_info, /v1/models, /metrics, /abort_request
  (sent on, applied once the scheduler runs), /tokenize, the simulator's own /sim/ routes.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from token_proxy.simulator.state import SIM_STATE, SimState

ANSWERED_WITHOUT_SCHEDULER = frozenset({
    "/model_info", "/get_model_info", "/v1/models", "/metrics", "/abort_request", "/get_weight_version",
    "/weight_version", "/tokenize", "/detokenize", "/generate",  # /generate: the engine's admission waits
})
HEALTH_PATHS = frozenset({"/health", "/health_generate"})


@web.middleware
async def scheduler_gate(request: web.Request, handler) -> web.StreamResponse:
    sim = request.app[SIM_STATE]
    path = request.path
    if sim.blocked is None or path in ANSWERED_WITHOUT_SCHEDULER or path.startswith(("/sim/", "/v1/")):
        return await handler(request)
    if path in HEALTH_PATHS:
        if not await _unblocked_within(sim, sim.config.health_check_timeout_s):
            return web.Response(status=503)  # SGLang's health probe got no token in time (empty body)
        return await handler(request)
    await request.read()  # the tokenizer process took the body; the scheduler takes the call later
    await _unblocked_within(sim, None)
    return await handler(request)


async def _unblocked_within(sim: SimState, timeout_s: float | None) -> bool:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while sim.blocked is not None and not sim.crashed:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        try:
            await asyncio.wait_for(sim.changed(), left)
        except asyncio.TimeoutError:
            return False
    return True


def add_scheduler_gate(app: web.Application) -> None:
    app.middlewares.append(scheduler_gate)
