"""The field readers' fast paths give what their slow paths give: the same values, and the same 400
message and `param` for the first bad item, over a table of inputs."""

from __future__ import annotations

import copy

import pytest

from token_proxy.api.fields import checked_ids, plain_ids, token_id_list
from token_proxy.errors import InvalidRequest

VOCAB = 1000

ID_LISTS = [
    [], [0], [999], [1, 2, 3], list(range(VOCAB)), [5] * 300,
    [7.0], [1, 2.0, 3], [1000], [-1], [0, 1000], [1, 2, -5, 3], [True], [1, False], [1, "2"], [None],
    [1, 2.5], [1, [2]], [1, {"a": 1}], [2**70], [1, 2**64], [1e30], [float("nan")], [float("inf")],
    [999, 1000.0], [3, 4.0, True],
]


def outcome(read, value):
    try:
        return "ok", read(value), value
    except InvalidRequest as exc:
        return "error", exc.message, exc.param


@pytest.mark.parametrize("value", ID_LISTS, ids=lambda v: repr(v)[:40])
def test_token_id_list_equals_the_item_by_item_check(value):
    fast = outcome(lambda v: token_id_list(v, "token_ids", VOCAB, allow_empty=True), copy.deepcopy(value))
    slow = outcome(lambda v: checked_ids(v, "token_ids", VOCAB), copy.deepcopy(value))
    assert fast == slow
    if fast[0] == "ok":
        assert [type(x) for x in fast[1]] == [type(x) for x in slow[1]]


def test_the_fast_path_takes_only_plain_ints_in_range():
    assert plain_ids([0, 1, 999], VOCAB) is True
    assert plain_ids([], VOCAB) is True
    assert plain_ids([1, 1000], VOCAB) is False
    assert plain_ids([-1, 1], VOCAB) is False
    assert plain_ids([1, True], VOCAB) is False
    assert plain_ids([1, 2.0], VOCAB) is False


def test_bad_items_keep_their_messages():
    with pytest.raises(InvalidRequest) as err:
        token_id_list([1, 2, 1000], "token_ids", VOCAB)
    assert (err.value.message, err.value.param) == (
        "token_ids: item 2 (1000) is out of range: token ids must be in [0, 1000)", "token_ids")
    with pytest.raises(InvalidRequest) as err:
        token_id_list([1, True], "prompt", VOCAB)
    assert (err.value.message, err.value.param) == ("prompt: item 1 must be an integer token id, got boolean",
                                                    "prompt")
    assert token_id_list([1, 2.0], "token_ids", VOCAB) == [1, 2]
