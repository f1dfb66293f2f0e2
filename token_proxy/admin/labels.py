"""No weight version without the weights behind it (issue 41.2): the rule every route that sets a version
label follows (vLLM's /finish_weight_update and SkyRL's finish, SGLang's and vLLM's /update_weight_version).

vLLM 0.33's worker (v1/worker/gpu_worker.py) refuses a finish that no start opened ("finish_weight_update
called without a matching start_weight_update.") and closes the update when a receive fails; its API server
answers that RuntimeError with a 500 (an Exception from the engine's utility call). Here it is a 409: the
client's order is wrong, not the server. An update is open from /start_weight_update (or a receive that
reached every worker: vLLM's /update_weights, SkyRL's, or a bucket of SGLang's own
/update_weights_from_distributed, as token_proxy.broadcast sends) until its finish; a push that failed since
closes it. A label-only route
(/update_weight_version) is refused while the last push failed and no weights were loaded since: the
workers hold the rolled-back (or partial) weights, which the label would misname.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from token_proxy.fleet import transaction as fleet
from token_proxy.fleet.plane import AdminPlane, StepResult


@dataclass
class OpenUpdate:
    """vLLM's `_weight_update_active`, for the fleet."""

    open: bool = False
    since: StepResult | None = None  # the plane's last push when it opened: a later failed one closes it

    def start(self, plane: AdminPlane) -> None:
        self.open, self.since = True, plane.push.last_step

    def refuse_finish(self, plane: AdminPlane, action: str) -> None:
        if not self.open:
            raise fleet.Conflict(f"{action} called without a matching start_weight_update: no weight update is "
                                 "open, so no version is set (POST /start_weight_update, then the weights, then "
                                 "the finish)")
        failed = _failed_push(plane)
        if failed is not None and failed is not self.since:
            self.open = False
            raise fleet.Conflict(f"{action}: the weight update failed ({failed.message}); no version is set on "
                                 "weights that did not arrive. Start the update again and send the weights")

    def finish(self) -> None:
        self.open, self.since = False, None


UPDATE: web.AppKey[OpenUpdate] = web.AppKey("open_update", OpenUpdate)


def add_label_state(app: web.Application) -> None:
    app[UPDATE] = OpenUpdate()


def refuse_label_after_failed_push(plane: AdminPlane, action: str) -> None:
    failed = _failed_push(plane)
    if failed is not None and not _loaded_since(plane, failed):
        raise fleet.Conflict(f"{action}: the last weight push failed ({failed.message}); the workers hold the "
                             "weights it left, which this version would misname. Push the weights again, or load a "
                             "checkpoint, first")


def _failed_push(plane: AdminPlane) -> StepResult | None:
    step = plane.push.last_step
    return step if step is not None and not step.ok else None


def _loaded_since(plane: AdminPlane, failed: StepResult) -> bool:
    """A version recorded after the failure (a load from disk, a complete push) stands on real weights."""
    return bool(plane.weights.history) and plane.weights.history[-1][0] > failed.finished_at
