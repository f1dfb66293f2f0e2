"""Fixtures for the admin plane's tests: weight-update groups without torch."""

from __future__ import annotations

import pytest

from token_proxy.simulator import params


class FakeTensor:
    """What the simulator's receive hands back, without torch (tests/admin/test_broadcast.py receives for real)."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def float(self):
        return self

    def numpy(self):
        return self

    def tobytes(self):
        return repr(self.shape).encode()


@pytest.fixture
def fake_group(monkeypatch):
    """torch is not installed here: the simulators join and receive without it (test_broadcast.py does it
    for real where torch is). Records every join."""
    joins = []

    def join(address, port, rank, world_size, group_name, backend, timeout_s):
        joins.append({"port": port, "rank": rank, "world_size": world_size, "backend": backend})
        return object()

    monkeypatch.setattr(params, "join_group", join)
    monkeypatch.setattr(params, "receive", lambda group, dtypes, shapes: [FakeTensor(s) for s in shapes])
    monkeypatch.setattr(params, "leave_group", lambda group: None)
    return joins
