"""The receiving rank's push loop (receiver.relay) over a recorded stream: double-buffered (bucket k+1 is received
before k's load is awaited; k is released only after its answer), and after a refusal the stream is drained to its
end with nothing more handed on."""

from __future__ import annotations

from tests.bridge.streams import ReplayChannel, recording
from token_proxy.bridge.receiver import PushSpec, buckets_of, relay
from token_proxy.bridge.wire import metas_from_update_info


class Logged(ReplayChannel):
    def __init__(self, rec, log):
        super().__init__(rec)
        self.log = log

    def recv(self, dtype, numel):
        self.log.append(f"recv{self.next}")
        return super().recv(dtype, numel)


def vllm_spec(rec) -> PushSpec:
    init = rec.doc["init_info"]
    return PushSpec("vllm", tuple(metas_from_update_info(rec.doc["update_info"])), init["packed"],
                    init["packed_buffer_size_bytes"])


def run(rec, spec, refuse_at=None):
    log: list[str] = []
    channel = Logged(rec, log)

    def ack(i):
        log.append(f"ack{i}")
        return (False, "unknown parameter") if i == refuse_at else (True, "Success")

    totals = relay(buckets_of(spec, channel), settle=lambda: log.append("settle"),
                   hand_on=lambda i, b: log.append(f"load{i}"), await_ack=ack, release=lambda: log.append("free"))
    return totals, log, channel


def test_double_buffered_order():
    totals, log, channel = run(recording("vllm_packed"), vllm_spec(recording("vllm_packed")))
    assert channel.finished()
    assert log == ["recv0", "settle", "load0",
                   "recv1", "settle", "ack0", "free", "load1",
                   "recv2", "settle", "ack1", "free", "load2",
                   "recv3", "settle", "ack2", "free", "load3",
                   "ack3", "free"]
    assert (totals.buckets, totals.tensors, totals.refused, totals.drained) == (4, 11, "", 0)
    assert totals.nbytes == sum(t["nbytes"] for t in recording("vllm_packed").doc["tensors"])


def test_a_refused_bucket_drains_the_rest_of_the_stream():
    totals, log, channel = run(recording("vllm_packed"), vllm_spec(recording("vllm_packed")), refuse_at=1)
    assert channel.finished()  # every broadcast the trainer makes is still received
    assert [e for e in log if e.startswith("load")] == ["load0", "load1"]
    assert (totals.buckets, totals.refused, totals.drained) == (4, "unknown parameter", 2)


def test_primerl_push_is_relayed_per_layer():
    rec = recording("primerl")
    totals, log, channel = run(rec, PushSpec("primerl"))
    assert channel.finished()
    assert [e for e in log if e.startswith("load")] == ["load0", "load1", "load2"]
    assert totals.tensors == len(rec.doc["tensors"])
