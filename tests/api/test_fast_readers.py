"""The field readers' fast paths give what their slow paths give: the same values, and the same 400
message and `param` for the first bad item, over a table of inputs."""

from __future__ import annotations

import copy

import pytest

from token_proxy.api import parse_sampling, token_id_list
from token_proxy.api.fields import checked_ids, opt_dict, opt_float, opt_int, plain_ids
from token_proxy.api.sampling import (
    RANGES,
    _constraint_from_response_format,
    _constraint_from_structured,
    _float,
    _int,
    _parse_constraint,
)
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


# --- api/sampling.py: an absent field returns its reader's default without calling the reader ----------

VALUES = [None, 0, 1, -1, 7.0, 2.5, True, "3", [1], 10**30, -(10**30), float("nan"), 0.5, 1.5, -2.0, 2**63]


def read(fn):
    try:
        return "ok", fn()
    except InvalidRequest as exc:
        return "error", exc.message, exc.param


@pytest.mark.parametrize("key", [k for k, r in RANGES.items() if r.integer])
def test_int_fields_read_as_opt_int(key):
    r = RANGES[key]
    for body in [{}, *({key: v} for v in VALUES)]:
        for default in (None, 0, 1):
            assert read(lambda b=body, d=default: _int(b, key, d)) == read(
                lambda b=body, d=default: opt_int(b, key, d, lo=r.lo, hi=r.hi)), (key, body, default)


@pytest.mark.parametrize("key", [k for k, r in RANGES.items() if not r.integer])
def test_float_fields_absent_or_null_are_none_as_opt_float_says(key):
    for body in ({}, {key: None}):
        assert _float(body, key) is None
        assert opt_float(body, key, lo=RANGES[key].lo, hi=RANGES[key].hi) is None


@pytest.mark.parametrize("body", [{}, {"response_format": None}, {"structured_outputs": None},
                                  {"response_format": None, "structured_outputs": None}, {"temperature": 1}])
def test_no_constraint_fields_give_what_the_readers_give(body):
    fmt = opt_dict(body, "response_format")
    slow = (None if fmt is None else _constraint_from_response_format(fmt)) or _constraint_from_structured(
        opt_dict(body, "structured_outputs") or {})
    assert _parse_constraint(body) is None and slow is None


SAMPLING_KEYS = ["use_beam_search", "best_of", "bad_words", "allowed_token_ids", "logits_processors", "logprobs",
                 "top_logprobs", "max_completion_tokens", "max_tokens", "n", "min_tokens", "temperature", "top_p",
                 "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "stop",
                 "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "seed", "logit_bias",
                 "skip_special_tokens", "spaces_between_special_tokens", "response_format", "structured_outputs",
                 "prompt_logprobs", "stream_interval"]


@pytest.mark.parametrize("body", [
    {}, {"max_tokens": 16, "temperature": 0, "ignore_eos": True}, {"max_completion_tokens": 8, "top_p": 0.9, "n": 2},
    {"max_tokens": 4, "min_tokens": 5}, {"top_p": 0}, {"temperature": "hot"}, {"n": 0}, {"seed": -1, "top_k": 0},
])
@pytest.mark.parametrize("count", [False, True])
def test_a_body_reads_the_same_with_its_absent_fields_null(body, count):
    """Null is what an absent field reads as; the fast path answers both without the reader."""
    filled = {**dict.fromkeys(SAMPLING_KEYS), **body}
    assert read(lambda: parse_sampling(body, VOCAB, logprobs_count=count)) == read(
        lambda: parse_sampling(filled, VOCAB, logprobs_count=count))
