"""The bridge's wait for the trainer's NCCL id (bridge/nccl.wait_for_unique_id), on CPU.

vLLM's PyNcclCommunicator turns itself off without a word when NCCLLibrary() raises in the trainer (vLLM 0.33 on
torch 2.11's NCCL 2.28.9: ncclCommSuspend is missing); the trainer then publishes no id under broadcast_from/0/0
and waits on the proxy's HTTP answer, so before this the bridge waited out the whole join timeout (300 s on the GPU
host) and said only that the store gave no id. Now, once every receiving rank is in the trainer's store, a missing
id after the grace is one line that names the cause and the fix. Fake store and clock; then torch's real TCPStore
where torch is installed (the GPU host, or a CPU torch: skipped in the proxy's torch-free venv)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from token_proxy.bridge.nccl import JOINED_KEY, JoinError, JoinSpec, wait_for_unique_id
from token_proxy.bridge.unpickle import UID_STORE_KEY


class FakeStore:
    """torch's Store calls the wait uses; `publish_at` is when (on the fake clock) the trainer sets the id."""

    def __init__(self, clock, publish_at=None, others=0):
        self.values, self.clock, self.publish_at = {JOINED_KEY: others}, clock, publish_at

    def add(self, key, n):
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]

    def check(self, keys):
        if self.publish_at is not None and self.clock.now >= self.publish_at:
            self.values[UID_STORE_KEY] = b"uid"
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def spec(world_size=2, timeout_s=300.0):
    return JoinSpec("10.0.0.7", 29501, world_size, 1, 0, timeout_s)


def wait(store, clock, s, grace_s=30.0):
    return wait_for_unique_id(store, s, lambda: "2.28.9", grace_s, clock, clock.sleep)


def test_a_published_id_is_returned_and_the_rank_counted():
    clock = Clock()
    store = FakeStore(clock, publish_at=1.0)
    assert wait(store, clock, spec()) == b"uid"
    assert store.values[JOINED_KEY] == 1
    assert clock.now < 1.5


def test_a_trainer_whose_pynccl_turned_off_is_named_after_the_grace_not_the_timeout():
    clock = Clock()
    with pytest.raises(JoinError) as caught:
        wait(FakeStore(clock), clock, spec())
    message = str(caught.value)
    assert 30.0 <= clock.now < 31.0  # the grace, not the 300 s timeout
    assert message.startswith("rank 1: every receiving rank has joined the trainer's store at 10.0.0.7:29501, "
                              "but the trainer published no NCCL id within 30 s: its PyNcclCommunicator turned "
                              "itself off")
    for cause in ("NCCL >= 2.29.7", "torch 2.11 ships 2.28.9", "VLLM_NCCL_SO_PATH", "VLLM_DISABLE_PYNCCL=1",
                  "pyzmq", "This bridge runs NCCL 2.28.9; the trainer's must be the same version"):
        assert cause in message
    assert "\n" not in message


def test_the_grace_starts_when_the_last_receiving_rank_arrives():
    clock = Clock()
    store = FakeStore(clock)
    def check(keys, _check=store.check):
        if clock.now >= 100 and store.values[JOINED_KEY] < 2:  # the other bridge's rank comes in at t=100
            store.values[JOINED_KEY] += 1
        return _check(keys)

    store.check = check
    with pytest.raises(JoinError, match="within 30 s: its PyNcclCommunicator turned itself off"):
        wait(store, clock, spec(world_size=3))
    assert 130.0 <= clock.now < 131.0


def test_ranks_missing_from_the_store_end_at_the_timeout_with_the_count():
    clock = Clock()
    with pytest.raises(JoinError) as caught:
        wait(FakeStore(clock), clock, spec(world_size=4, timeout_s=60.0))
    assert str(caught.value) == ("rank 1: the trainer's store at 10.0.0.7:29501 gave no NCCL id within 60 s (1 of 3 "
                                 "receiving rank(s) had joined it)")
    assert 60.0 <= clock.now < 60.5


def test_a_timeout_shorter_than_the_grace_is_the_plain_timeout():
    clock = Clock()
    with pytest.raises(JoinError, match=r"gave no NCCL id within 10 s \(1 of 1 receiving rank"):
        wait(FakeStore(clock), clock, spec(timeout_s=10.0))


def test_torchs_tcpstore_a_silent_trainer_and_a_publishing_one():
    dist = pytest.importorskip("torch.distributed")
    master = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=timedelta(seconds=20),
                           use_libuv=False, wait_for_workers=False)  # vLLM's create(): the trainer is the master
    client = dist.TCPStore("127.0.0.1", master.port, world_size=2, is_master=False, timeout=timedelta(seconds=20))
    s = JoinSpec("127.0.0.1", master.port, 2, 1, 0, 20.0)
    with pytest.raises(JoinError, match="published no NCCL id within 0.5 s"):
        wait_for_unique_id(client, s, lambda: "x", grace_s=0.5)
    master.set(UID_STORE_KEY, b"\x01" * 128)
    assert wait_for_unique_id(client, s, lambda: "x", grace_s=0.5) == b"\x01" * 128
