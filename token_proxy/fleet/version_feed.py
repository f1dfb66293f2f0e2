"""The fleet's version record, published: one answer and one reader for its two readers.

- A follower proxy (--fleet-controller, ownership.py's ControllerMirror) polls its controller: GET /fleet/versions.
- A --workers serving process (serving/fleet_mirror.py) polls its admin owner on the owner's socket:
  GET /_internal/fleet_versions (serving/control.py's row).
Both are this handler, a long poll: `?seen=N&wait=S` answers once the record's sequence differs from N, or after S
seconds (at most 60). The answer:
  {"seq": N, "now": the answering process's CLOCK_MONOTONIC, "controller": false once it stood down,
   "record": VersionRecord.as_dict()}
and `read` turns it back into (seq, VersionRecord) on the reader's clock: a follower on another host shifts the
record's times by (its now - the controller's now); a serving process shares the owner's host clock and does not.
"""

from __future__ import annotations

import math
import time

from aiohttp import web

from token_proxy.fleet.plane import ADMIN
from token_proxy.fleet.versions import VersionRecord
from token_proxy.http_io import json_response

MAX_WAIT_S = 60.0


async def fleet_versions(request: web.Request) -> web.Response:
    plane = request.app[ADMIN]
    try:
        seen, wait = int(request.query.get("seen", -1)), min(float(request.query.get("wait", 0)), MAX_WAIT_S)
    except ValueError:
        seen, wait = -1, 0.0
    await plane.news.wait_for_change(seen, max(wait, 0.0))
    return json_response({"seq": plane.news.seq, "now": time.monotonic(), "controller": plane.stood_down is None,
                          "record": plane.version_record().as_dict()})


def query(seen: int, wait_s: float) -> dict[str, str]:
    return {"seen": str(seen), "wait": str(wait_s)}


def read(data: dict, same_clock: bool) -> tuple[int, VersionRecord]:
    """The answer's sequence and record, the record's times on this process's clock."""
    record = VersionRecord.of(data["record"])
    if not same_clock:
        record = shifted(record, time.monotonic() - float(data["now"]))
    return int(data["seq"]), record


def shifted(record: VersionRecord, offset: float) -> VersionRecord:
    """`record` with its times moved by `offset` (ours minus theirs)."""
    return VersionRecord(record.current, record.initial, [(t + offset, v) for t, v in record.history],
                         {v: until if math.isinf(until) else until + offset for v, until in record.incoming.items()},
                         record.unavailable, record.joining)
