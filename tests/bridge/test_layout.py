"""The rank layout: one receiving rank per SGLang GPU (or per worker), rank offsets, and the refusals."""

from __future__ import annotations

import pytest

from token_proxy.bridge.layout import Gpu, LayoutError, Receiver, plan_receivers

A0, A1 = Gpu("http://a", 0, 0), Gpu("http://a", 1, 1)
B0, B1 = Gpu("http://b", 0, 2), Gpu("http://b", 1, 3)


def test_one_rank_per_gpu_from_the_offset():
    plan = plan_receivers([A0, A1, B0, B1], world_size=5, rank_offset=1, ranks=4)
    assert plan == [Receiver(1, 0, (A0,)), Receiver(2, 1, (A1,)), Receiver(3, 2, (B0,)), Receiver(4, 3, (B1,))]


def test_one_rank_per_worker_feeds_every_tp_rank():
    plan = plan_receivers([A1, A0, B0, B1], world_size=4, rank_offset=2, ranks=2)
    assert plan == [Receiver(2, 0, (A0, A1)), Receiver(3, 2, (B0, B1))]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"world_size": 5, "rank_offset": 0, "ranks": 4}, "rank 0 is the trainer's sender"),
    ({"world_size": 4, "rank_offset": 1, "ranks": 4}, "ranks 1..4 do not fit a group of 4"),
    ({"world_size": 4, "rank_offset": 1, "ranks": 3}, ("gives this bridge 3 rank\\(s\\), but it serves 4 SGLang GPU\\(s\\) "
                                                      "on 2 worker\\(s\\): size the trainer's inference world to 4")),
])
def test_refusals(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        plan_receivers([A0, A1, B0, B1], **kwargs)


def test_two_ranks_on_one_gpu_are_refused():
    with pytest.raises(LayoutError, match="GPU 0 is used by http://a and http://b"):
        plan_receivers([A0, Gpu("http://b", 0, 0)], world_size=3, rank_offset=1, ranks=2)
