"""The admin plane: prime-rl's API (prime_rl.py), vLLM's RL routes (vllm_rl.py) and SGLang's forwarded
ones (forward.py), each fanned out to every SGLang worker through `AdminPlane` (workers.py), with the
weight-update fence, flushes and fleet transactions beside them. Rows in routes.py register the handlers."""

from token_proxy.admin.fence import add_fence
from token_proxy.admin.forward import add_passthrough
from token_proxy.admin.prime_rl import add_admin_state
from token_proxy.admin.workers import ADMIN, AdminPlane, StepResult

__all__ = [
    "ADMIN", "AdminPlane", "StepResult", "add_admin_state", "add_fence", "add_passthrough",
]
