"""sglang/picture.py's agree(): the facts a fleet of SGLang workers agrees on, and each worker that differs
named once per fact (pure; the real router runs in test_router.py)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from token_proxy.sglang import SGLangPicture
from token_proxy.sglang.picture import BackendInfo, agree, picture_of
from token_proxy.sglang.versions import features_for

A, B, C = "http://a:30000", "http://b:30000", "http://c:30000"
BASE = BackendInfo(served_model_name="m", tokenizer_path="/tok", max_model_len=4096, incremental_stream=True,
                   weight_version="1", model_path="/m", max_prompt_len=4089, honours_seed=True,
                   max_total_num_tokens=1000, page_size=1, api=features_for("0.5.17"), metrics_enabled=True)


def worker(**changes) -> BackendInfo:
    return dataclasses.replace(BASE, **changes)


def lines(workers: dict[str, BackendInfo]) -> list[tuple[str, str, int, bool]]:
    return [(d.url, d.fact, d.level, d.fatal) for d in agree(workers)[1]]


def test_one_worker_agrees_with_itself():
    agreed, found = agree({A: BASE})
    assert (agreed, found) == (BASE, [])
    picture = picture_of(A, {A: BASE})
    assert (picture.behind_router, picture.worker_urls, picture.agreed) == (False, [A], BASE)
    assert picture.describe() == ("SGLang 0.5.17 (verified against a real 0.5.17 server), incremental streams, "
                                  f"from {A}")


def test_workers_that_agree_give_their_facts_and_no_line():
    picture = picture_of("http://router:30000", {A: BASE, B: BASE})
    assert (picture.agreed, picture.disagreements, picture.behind_router) == (BASE, (), True)
    assert picture.describe().endswith("incremental streams, from 2 workers behind http://router:30000")


def test_the_smallest_limits_and_the_strictest_flags_are_agreed():
    agreed, _ = agree({A: BASE, B: worker(max_model_len=2048, max_prompt_len=2041, max_total_num_tokens=500,
                                          honours_seed=False, metrics_enabled=None)})
    assert (agreed.max_model_len, agreed.max_prompt_len, agreed.max_total_num_tokens) == (2048, 2041, 500)
    assert (agreed.honours_seed, agreed.metrics_enabled) == (False, None)
    assert agree({A: worker(metrics_enabled=False), B: worker(metrics_enabled=None)})[0].metrics_enabled is False


def test_the_worker_that_differs_from_most_is_named_with_its_fact_and_level():
    assert lines({A: BASE, B: worker(max_model_len=2048), C: BASE}) == [(B, "context length", logging.INFO, False)]
    assert lines({A: worker(tokenizer_path="/other"), B: BASE, C: BASE}) == [(A, "tokenizer", logging.WARNING, False)]
    (line,) = agree({A: BASE, B: BASE, C: worker(honours_seed=False)})[1]
    assert line.line == ("SGLang worker http://c:30000 differs in seed honouring: False, where http://a:30000 "
                         "has True; seeds count as unhonoured")


def test_a_version_mismatch_is_an_error_and_the_oldest_release_is_used():
    newer = worker(api=features_for("0.5.23"))
    agreed, found = agree({A: newer, B: BASE, C: newer})
    assert [(d.url, d.fact, d.level) for d in found] == [(B, "version", logging.ERROR)]
    assert found[0].line == ("SGLang worker http://b:30000 differs in version: '0.5.17', where http://a:30000 "
                             "has '0.5.23'; the proxy uses the oldest release's behaviour for all; run one release")
    assert agreed.api.generation == "0.5.17"
    assert agreed.api.sampling_keys == features_for("0.5.17").sampling_keys & features_for("0.5.23").sampling_keys


@pytest.mark.parametrize("usual", [True, False])
def test_a_stream_mode_mismatch_is_fatal_and_says_the_fix(usual):
    _, found = agree({A: worker(incremental_stream=usual), B: worker(incremental_stream=not usual),
                      C: worker(incremental_stream=usual)})
    assert [(d.url, d.fact, d.level, d.fatal) for d in found] == [(B, "stream mode", logging.ERROR, True)]
    modes = ("'cumulative'", "'incremental'") if usual else ("'incremental'", "'cumulative'")
    flag = "with" if usual else "without"
    assert found[0].line == (f"SGLang worker {B} differs in stream mode: {modes[0]}, where {A} has {modes[1]}; "
                             f"no stream through the router can be read right: restart it {flag} "
                             "--incremental-streaming-output, like the others")


def test_a_tie_is_named_against_the_first_listed_worker():
    assert lines({A: BASE, B: worker(weight_version="2")}) == [(B, "weight version", logging.WARNING, False)]


def test_the_picture_is_frozen():
    picture = picture_of(A, {A: BASE})
    with pytest.raises(dataclasses.FrozenInstanceError):
        picture.agreed = BASE  # type: ignore[misc]
    with pytest.raises(TypeError):
        picture.workers[B] = BASE  # type: ignore[index]
    assert isinstance(picture, SGLangPicture)


def test_agree_needs_a_worker():
    with pytest.raises(ValueError, match="at least one worker"):
        agree({})
