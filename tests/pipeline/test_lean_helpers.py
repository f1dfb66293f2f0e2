"""The request path's small helpers that replaced library calls for CPU (issue 40.1): each keeps the behaviour of
what it replaced (uuid4().hex; asynccontextmanager-based gate and abort guard)."""

from __future__ import annotations

import asyncio
import re
import uuid

import pytest

from token_proxy.errors import BackendTimeout
from token_proxy.pipeline.request_state import new_request_id, random_uuid
from token_proxy.sglang.client import aborting_on_exit
from token_proxy.sglang.in_flight import Gate


def test_random_uuid_is_a_version_4_uuid_in_hex():
    seen = {random_uuid() for _ in range(2000)}
    assert len(seen) == 2000
    for value in seen:
        assert re.fullmatch(r"[0-9a-f]{32}", value)
        parsed = uuid.UUID(hex=value)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122 and parsed.hex == value
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", new_request_id("chatcmpl", None))
    assert new_request_id("cmpl", "mine") == "cmpl-mine"


async def test_the_gate_counts_who_passes_and_holds_them_while_closed():
    gate = Gate()
    async with gate.through():
        assert gate.passing == 1
    assert gate.passing == 0
    entered = asyncio.Event()

    async def one():
        async with gate.through():
            entered.set()
            await asyncio.sleep(0)

    async with gate.closed():
        task = asyncio.create_task(one())
        await asyncio.sleep(0.01)
        assert not entered.is_set() and gate.passing == 0
    await asyncio.wait_for(task, 1)
    assert entered.is_set() and gate.passing == 0
    with pytest.raises(RuntimeError):
        async with gate.through():
            raise RuntimeError("boom")
    assert gate.passing == 0


class _Ctx:
    def __init__(self):
        self.in_flight: dict[str, list[str]] = {}
        self.aborted: list[str] = []
        self.client = self

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def spawn(self, coro):
        return asyncio.get_running_loop().create_task(coro)


@pytest.mark.parametrize("error, aborts, client_gone", [
    (None, False, False), (ValueError("x"), False, False), (asyncio.CancelledError(), True, True),
    (ConnectionResetError(), True, True), (BackendTimeout("late"), True, False)])
async def test_aborting_on_exit_aborts_only_when_the_client_left_or_time_ran_out(error, aborts, client_gone):
    ctx, gone = _Ctx(), []
    rids = ["cmpl-7-0", "cmpl-7-1"]

    async def block():
        async with aborting_on_exit(ctx, rids, lambda: gone.append(True)):
            assert ctx.in_flight == {"cmpl-7": rids}
            if error is not None:
                raise error

    if error is None:
        await block()
    else:
        with pytest.raises(type(error)):
            await block()
    await asyncio.sleep(0)
    assert ctx.in_flight == {}
    assert ctx.aborted == (rids if aborts else [])
    assert gone == ([True] if client_gone else [])


async def test_aborting_on_exit_leaves_a_later_request_with_the_same_id_listed():
    ctx = _Ctx()
    async with aborting_on_exit(ctx, ["chatcmpl-x"]):
        later = ctx.in_flight["chatcmpl-x"] = ["chatcmpl-x"]
    assert ctx.in_flight == {"chatcmpl-x": later}
