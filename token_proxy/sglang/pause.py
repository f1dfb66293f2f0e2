"""Pause modes: each admin dialect's names, mapped onto SGLang's /pause_generation modes (one table).

SGLang's own modes (settings.SGLANG_PAUSE_MODES, the values of --pause-mode): "retract" re-queues
in-flight requests and frees their KV, "in_place" keeps it, "abort" ends them. prime-rl's /pause
(a JSON body) and vLLM's (?mode=) name them their own way; "keep" is the configured --pause-mode.
"""

from __future__ import annotations

from token_proxy.errors import InvalidRequest
from token_proxy.settings import SGLANG_PAUSE_MODES

PRIME_RL, VLLM = "prime-rl", "vllm"
_CONFIGURED = None  # "keep": the --pause-mode SGLang mode

# Per dialect, its mode names (in the order its refusal lists them) -> SGLang's mode.
MODES = {
    PRIME_RL: {"keep": _CONFIGURED, **{mode: mode for mode in ("abort", "retract", "in_place")}},
    # vLLM's three (wait: drain first, then hold in place), then SGLang's own two.
    VLLM: {"abort": "abort", "wait": "in_place", "keep": _CONFIGURED, "retract": "retract", "in_place": "in_place"},
}
assert all(set(m.values()) - {_CONFIGURED} <= set(SGLANG_PAUSE_MODES) for m in MODES.values())
_EXPECTED = {PRIME_RL: "keep, abort, retract or in_place", VLLM: "abort, wait or keep (or SGLang's retract, in_place)"}


def checked_mode(mode, dialect: str) -> str:
    """`mode` if the dialect names it, else a 400 naming the dialect's modes."""
    if not isinstance(mode, str) or mode not in MODES[dialect]:
        raise InvalidRequest(f"mode must be {_EXPECTED[dialect]}, got {mode!r}", param="mode")
    return mode


def to_sglang(mode, dialect: str, configured: str) -> str:
    """The SGLang mode for a dialect's `mode` (checked); `configured` (--pause-mode) for "keep"."""
    native = MODES[dialect][checked_mode(mode, dialect)]
    return configured if native is _CONFIGURED else native
