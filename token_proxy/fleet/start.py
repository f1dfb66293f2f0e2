"""What a controller takes as the fleet's weights when it starts in front of workers that already serve
(pure; `fleet/plane.py` applies it once SGLang is known).

The rule never relabels anything:
- the fleet's version is the one most workers report; a tie goes to the first worker's (in --worker or
  sglang-router order);
- the checkpoint that holds it is known only when EVERY worker reports one (model_path, weight_version)
  pair. It is then taken as a start-up fact, not a proof: SGLang's /model_info keeps the last disk path
  after an NCCL push, so the pair may name a path that does not hold the version (issue 37, finding 2).
  The fence proves it (its weights checksum against a healthy worker's) before a heal labels anything
  with it (fence.py). When the workers disagree no checkpoint is known: the workers on other versions are
  fenced and held, never healed, until the next weight update through the controller brings them in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StartState:
    version: str | None
    checkpoint: str | None  # the path taken to hold `version`; None: none is known
    seen: frozenset[str]  # every version a worker reported (none is another controller's doing)
    note: str | None  # one line when the workers disagree


def start_state(pairs: list[tuple[str, str | None, str | None]]) -> StartState:
    """`pairs`: (url, model_path, weight_version) of every worker, in worker order."""
    versions = [version for _, _, version in pairs if version is not None]
    if not versions:
        return StartState(None, None, frozenset(), None)
    counts = Counter(versions)
    top = max(counts.values())
    version = next(v for v in versions if counts[v] == top)  # the first worker's among the most reported
    agreed = {(path, v) for _, path, v in pairs}
    checkpoint = pairs[0][1] if len(agreed) == 1 else None
    note = None
    if len(agreed) > 1:
        others = ", ".join(f"{url} ({v!r} from {path})" for url, path, v in pairs if v != version)
        note = (f"the workers disagree at start: the fleet's version is {version!r} (most workers report it); "
                f"no checkpoint is known to hold it, so {others or 'none'} stay fenced until the next weight "
                "update (none is relabelled)")
    return StartState(version, checkpoint, frozenset(versions), note)
