"""The admin plane: prime-rl's API (prime_rl.py), vLLM's RL routes (vllm_rl.py) and SGLang's forwarded
ones (forward.py), each fanned out to every SGLang worker through `AdminPlane` (workers.py), with the
weight-update fence, flushes and fleet transactions beside them. Rows in routes.py register the handlers."""

from token_proxy.faces import door

__all__ = [
    "ADMIN", "AdminPlane", "StepResult", "add_admin_state", "add_fence", "add_passthrough",
]

__getattr__ = door(__name__, {
    "ADMIN": "workers",
    "AdminPlane": "workers",
    "StepResult": "workers",
    "add_admin_state": "prime_rl",
    "add_fence": "fence",
    "add_passthrough": "forward",
})
