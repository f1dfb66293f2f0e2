"""fleet/plane.py's AdminPlane, without a server: it holds the workers' fan-out (sglang/workers.py) and its
state in named parts; which calls set a weight version is the route table's `version_key`, one row per path."""

from __future__ import annotations

import math

import orjson

from token_proxy.fleet import AdminPlane, weight_session
from token_proxy.fleet.plane import FenceMarks, FleetControl, NcclPush, WeightRecord
from token_proxy.routes import ROUTES
from token_proxy.settings import Settings
from token_proxy.sglang import Workers
from token_proxy.sglang.picture import BackendInfo
from token_proxy.sglang.versions import features_for

A, B, REMOVED = "http://a:1", "http://b:1", "http://c:1"


class Recorder:
    """An SGLang client stand-in: every call answers 200 {"success": true} and is recorded."""

    def __init__(self, base_url: str, calls: list):
        self.base_url, self.calls = base_url, calls

    def at(self, url: str) -> Recorder:
        return Recorder(url, self.calls)

    async def call(self, method, path, raw, timeout_s):
        self.calls.append((self.base_url, path, orjson.loads(raw) if raw else None))
        return 200, b'{"success": true}', "application/json"


def version_keys() -> dict[str, str]:
    return {row.path: row.version_key for row in ROUTES if row.version_key}


async def test_the_plane_holds_the_fan_out_and_reaches_the_workers_the_fence_took_out_of_the_router():
    calls: list = []
    settings = Settings(backend_url=A, workers=(A, B))
    plane = AdminPlane(settings=settings, workers=Workers(settings=settings, client=Recorder(A, calls)),
                       version_keys=version_keys())
    assert not isinstance(plane, Workers)
    assert [type(part) for part in (plane.weights, plane.control, plane.fenced, plane.push)] == [
        WeightRecord, FleetControl, FenceMarks, NcclPush]
    plane.fenced.router_removed[REMOVED] = None
    replies = await plane.fan_out("POST", "/flush_cache", None, 5.0)
    assert [r.url for r in replies] == [A, B, REMOVED] and all(r.ok for r in replies)
    assert plane.workers.last_urls == (A, B)  # the list itself; the fence's own come on top


async def test_a_call_that_sets_a_version_marks_it_incoming_by_its_rows_key():
    calls: list = []
    settings = Settings(backend_url=A, workers=(A,))
    plane = AdminPlane(settings=settings, workers=Workers(settings=settings, client=Recorder(A, calls)),
                       version_keys=version_keys())
    seq = plane.news.seq
    await plane.fan_out("POST", "/update_weight_version", {"new_version": "7"}, 5.0)
    await plane.fan_out("POST", "/update_weights_from_disk", {"model_path": "/m", "weight_version": 8}, 5.0)
    await plane.fan_out("POST", "/flush_cache", {"weight_version": "not a setter"}, 5.0)
    incoming = plane.weights.incoming
    assert set(incoming) == {"7", "8"} and not any(math.isinf(until) for until in incoming.values())
    assert {"7", "8"} <= plane.weights.known_versions and "not a setter" not in plane.weights.known_versions
    assert plane.news.seq == seq + 4  # marked at the start and at the end of each setter
    assert [path for _, path, _ in calls] == ["/update_weight_version", "/update_weights_from_disk", "/flush_cache"]


def test_pause_and_a_pushs_answer_live_in_their_parts():
    settings = Settings(backend_url=A)
    plane = AdminPlane(settings=settings, workers=Workers(settings=settings, client=Recorder(A, [])),
                       version_keys={})
    plane.mark_paused()
    assert plane.control.paused is True and plane.push.paused_at > 0 and not plane.push.waiting()


async def test_a_workers_api_generation_is_read_from_the_picture_and_asked_only_where_it_lacks_one():
    calls: list = []
    settings = Settings(backend_url=A, workers=(A, B))
    plane = AdminPlane(settings=settings, workers=Workers(settings=settings, client=Recorder(A, calls)),
                       version_keys={})
    pictured = {A: BackendInfo("m", "m", 4096, True, api=features_for("0.5.17"))}
    plane.facts = lambda url: pictured.get(url)
    old, unknown = await weight_session.worker_apis(plane, [A, B])
    assert (old.version, old.weight_update_session) == ("0.5.17", False)
    assert (unknown.version, unknown.weight_update_session) == (None, True)  # no version said: the newest known
    assert calls == [(B, "/server_info", None)]  # A's came from the picture
    assert await weight_session.gated(plane, [A, B]) == [B]


class PushingWorkers(Recorder):
    """Two workers in one NCCL push: A takes the last bucket (and reports its version) at once, B only when
    released; /model_info answers each worker's version."""

    def __init__(self, base_url: str, calls: list, versions: dict, released):
        super().__init__(base_url, calls)
        self.versions, self.released = versions, released

    def at(self, url: str) -> PushingWorkers:
        return PushingWorkers(url, self.calls, self.versions, self.released)

    async def call(self, method, path, raw, timeout_s):
        if path == "/model_info":
            return 200, orjson.dumps({"weight_version": self.versions[self.base_url]}), "application/json"
        if path == "/update_weights_from_distributed":
            if self.base_url == B:
                await self.released.wait()
            self.versions[self.base_url] = orjson.loads(raw)["weight_version"]
        return await super().call(method, path, raw, timeout_s)


async def test_a_worker_that_took_a_pushs_last_bucket_first_is_not_fenced_while_the_others_receive():
    """The CI failure of stop 43 (tests/fleet/test_per_node_nccl.py): the forwarded bucket went around the
    plane's version marking, and the fence fenced (paused, mode abort) the worker that finished first."""
    import asyncio

    from token_proxy.fleet.fence import Fence

    versions, released = {A: "default", B: "default"}, asyncio.Event()
    settings = Settings(backend_url=A, workers=(A, B))
    plane = AdminPlane(settings=settings, workers=Workers(settings=settings,
                                                          client=PushingWorkers(A, [], versions, released)),
                       version_keys=version_keys())
    plane.weights.version = "default"
    bucket = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]], "weight_version": "7"}
    push = asyncio.create_task(plane.fan_out_until_failure("POST", "/update_weights_from_distributed", bucket,
                                                           5.0, [A, B]))
    while versions[A] != "7":
        await asyncio.sleep(0.001)
    fence = Fence(plane, 0.05)
    await fence.check()
    assert (fence.fenced, plane.version_record().incoming) == ({}, {"7": math.inf})
    released.set()
    assert [r.ok for r in await push] == [True, True]
    assert not math.isinf(plane.weights.incoming["7"])  # a grace after the call, then forgotten
