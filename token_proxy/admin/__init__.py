"""The admin plane: prime-rl's API (prime_rl.py), vLLM's RL routes (vllm_rl.py) and SGLang's forwarded
ones (forward.py), each fanned out to every SGLang worker through `AdminPlane`. The fleet's weights
(the plane's state, transactions, the fence, flushes) live in token_proxy/fleet/; the plane's key and
types are on this face too, since every admin handler reads them. Rows in routes.py register the handlers."""

from token_proxy.admin.forward import add_passthrough
from token_proxy.admin.prime_rl import add_admin_state
from token_proxy.fleet.plane import ADMIN, AdminPlane, StepResult

__all__ = [
    "ADMIN", "AdminPlane", "StepResult", "add_admin_state", "add_passthrough",
]
