"""The one error the trainer side raises."""

from __future__ import annotations


class BroadcastError(RuntimeError):
    """The engine refused, a peer never joined or died, a push did not finish in time, or this process's
    NCCL cannot talk to SGLang's."""
