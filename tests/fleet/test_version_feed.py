"""The fleet's version record has one long-poll answer and one reader (fleet/version_feed.py): what a follower
reads from its controller's GET /fleet/versions is what a --workers serving process reads from its owner's
GET /_internal/fleet_versions (tests/serving/test_workers.py runs that one end to end)."""

from __future__ import annotations

import asyncio
import math
import time

from token_proxy.fleet import VersionRecord, version_feed
from token_proxy.serving.control import CONTROL_ROUTES


async def test_the_answer_carries_the_record_and_the_clock_it_was_read_on(make_sim, make_proxy):
    proxy = await make_proxy(await make_sim())
    reply = await proxy.get("/fleet/versions", params=version_feed.query(-1, 0))
    data = await reply.json()
    assert (reply.status, sorted(data)) == (200, ["controller", "now", "record", "seq"])
    assert data["controller"] is True
    assert data["record"] == {"current": "default", "initial": "default", "history": [], "incoming": {},
                              "unavailable": None, "joining": None}
    seq, record = version_feed.read(data, same_clock=True)
    assert (seq, record.current, record.joining) == (data["seq"], "default", None)
    waited = time.monotonic()
    again = await proxy.get("/fleet/versions", params=version_feed.query(seq, 0.3))  # nothing new: waits it out
    assert ((await again.json())["seq"], time.monotonic() - waited >= 0.3) == (seq, True)


def test_a_reader_on_another_clock_shifts_every_time_and_keeps_the_rest():
    record = VersionRecord("2", "1", [(100.0, "2")], {"3": math.inf, "4": 150.0}, "held", "joining: ...")
    data = {"seq": 7, "now": time.monotonic() - 50.0, "controller": True, "record": record.as_dict()}
    seq, same = version_feed.read(data, same_clock=True)
    assert (seq, same) == (7, record)
    _, moved = version_feed.read(data, same_clock=False)
    assert round(moved.history[0][0] - 150.0) == 0 and round(moved.incoming["4"] - 200.0) == 0
    assert (moved.incoming["3"], moved.current, moved.unavailable, moved.joining) == (
        math.inf, "2", "held", "joining: ...")


def test_the_owner_route_is_the_same_handler_as_the_controllers():
    [row] = [r for r in CONTROL_ROUTES if r.path == "/_internal/fleet_versions"]
    assert (row.methods, row.handler) == (("GET",), version_feed.fleet_versions)
    assert asyncio.iscoroutinefunction(row.handler)
