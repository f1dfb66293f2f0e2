"""The fleet's weights, a feature that hooks into the pipeline: the admin plane (plane.py: `AdminPlane`,
which holds the workers' fan-out and the fleet's state in named parts), the version record the data path
judges replies by (versions.py), one weight update for every worker at once (transaction.py), the fence that keeps a
restarted or drifted worker out and heals it (fence.py), prefix-cache flushes (flush.py), SGLang's
weight-update session (weight_session.py) and sglang-router's worker list (router_list.py)."""

from token_proxy.fleet.fence import FENCE, add_fence
from token_proxy.fleet.plane import ADMIN, AdminPlane, StepResult
from token_proxy.fleet.versions import VersionRecord

__all__ = ["ADMIN", "FENCE", "AdminPlane", "StepResult", "VersionRecord", "add_fence"]
