"""Fixtures for the admin plane's tests: weight-update groups without torch."""

from __future__ import annotations

import pytest

from tests.support.admin_fixtures import FakeTensor
from token_proxy.simulator import params


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
