"""bench/fleet_round.py's ledger (the GPU fleet round's accounting, issue 28): how each rollout is judged (whole,
streamed, stale), the fleet's versions over time, and the per-phase rows and table. Pure: no processes."""

from __future__ import annotations

import json

import pytest

from tests.support.bench_modules import load_bench_module


@pytest.fixture(scope="module")
def fleet():
    return load_bench_module("fleet_round")


def whole(ids: list[int], version: str | None = "v1", finish: str = "length") -> dict:
    choice = {"token_ids": ids, "finish_reason": finish}
    if version is not None:
        choice["weight_versions"] = [{"version": version, "start": 0, "end": len(ids)}]
    return {"choices": [choice]}


def sse(*events, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def chunk(ids: list[int], finish: str | None = None, version: str | None = None) -> dict:
    choice = {"index": 0, "delta": {"content": "x"}, "finish_reason": finish, "token_ids": ids}
    if version is not None:
        choice["weight_versions"] = [{"version": version, "start": 0, "end": 4}]
    return {"choices": [choice]}


def test_version_clock_holds_every_version_of_the_spans_a_rollout_overlaps(fleet):
    clock = fleet.VersionClock("default", 0.0)
    clock.set({"default", "v1"}, 10.0)  # a push under way
    clock.set({"v1"}, 12.0)
    assert clock.current == frozenset({"v1"})
    assert clock.held_between(1.0, 9.0) == frozenset({"default"})
    assert clock.held_between(9.0, 11.0) == frozenset({"default", "v1"})
    assert clock.held_between(5.0, 20.0) == frozenset({"default", "v1"})
    assert clock.held_between(12.0, 13.0) == frozenset({"v1"})  # a span starting at the end counts
    assert clock.held_between(12.5, 13.0) == frozenset({"v1"})


def test_whole_replies(fleet):
    assert fleet.judge_whole(200, whole([1, 2, 3, 4]), 4) == ("ok", "", "v1")
    assert fleet.judge_whole(200, whole([1]), 4) == ("lost", "1 of 4 tokens (length)", "v1")
    assert fleet.judge_whole(200, {"object": "x"}, 4) == ("lost", "200 without choices", None)
    busy = {"error": {"message": "SGLang at X is unreachable", "code": 503}}
    assert fleet.judge_whole(503, busy, 4) == ("lost", "503: SGLang at X is unreachable", None)
    assert fleet.judge_whole(502, "<html>bad gateway</html>", 4) == ("lost", "502: <html>bad gateway</html>", None)


def test_streamed_replies(fleet):
    full = sse(chunk([]), chunk([1, 2]), chunk([3, 4], "length", "v2"))
    assert fleet.judge_stream(200, full, 4) == ("ok", "", "v2")
    cut = sse(chunk([]), chunk([7]), chunk([], "length", "default"))  # what main does through sglang-router
    assert fleet.judge_stream(200, cut, 4) == ("lost", "stream cut: 1 of 4 tokens (length)", "default")
    unfinished = sse(chunk([1, 2]), chunk([3, 4], "length", "v2"), done=False)
    assert fleet.judge_stream(200, unfinished, 4) == ("lost", "stream without [DONE]", "v2")
    failed = sse(chunk([1]), {"error": {"message": "SGLang failed mid-stream", "code": 502}})
    assert fleet.judge_stream(200, failed, 4) == ("lost", "error event: SGLang failed mid-stream", None)
    refused = json.dumps({"error": {"message": "paused", "code": 409}}).encode()
    assert fleet.judge_stream(409, refused, 4) == ("lost", "409: paused", None)


def test_a_whole_reply_on_a_version_the_fleet_did_not_hold_is_stale(fleet):
    held = frozenset({"7"})
    assert fleet.with_version("ok", "", "7", held) == ("ok", "")
    assert fleet.with_version("ok", "", "default", held) == ("stale", "served 'default' while the fleet held ['7']")
    assert fleet.with_version("ok", "", None, held) == ("stale", "served None while the fleet held ['7']")
    assert fleet.with_version("lost", "stream cut", "default", held) == ("lost", "stream cut")  # lost first


def test_rows_count_each_rollout_in_the_phase_it_was_sent_in(fleet):
    rollouts = [fleet.Rollout("steady", True, 0, 1, "ok", "", "default"),
                fleet.Rollout("steady", False, 0, 1, "ok", "", "default"),
                fleet.Rollout("kill-b", True, 5, 6, "lost", "stream cut: 1 of 16 tokens (length)", "7"),
                fleet.Rollout("kill-b", False, 5, 6, "stale", "served 'default' while the fleet held ['7']",
                              "default"),
                fleet.Rollout("kill-b", False, 5, 6, "stale", "served 'default' while the fleet held ['7']",
                              "default"),
                fleet.Rollout("kill-b", False, 5, 6, "ok", "", "7")]
    actions = {"steady": (0.5, ["GET /weight_info 200"], True), "kill-b": (41.234, ["kill -9 worker B: exit 0"], True),
               "disk": (3.0, ["FAILED POST /update_weights 400"], False)}
    steady, kill, disk = fleet.rows_of(["steady", "kill-b", "disk"], rollouts, actions)
    assert (steady.sent, steady.ok, steady.lost, steady.stale, steady.streamed, steady.passed) == (2, 2, 0, 0, 1, True)
    assert (kill.sent, kill.ok, kill.lost, kill.stale, kill.streamed, kill.passed) == (4, 1, 1, 2, 1, False)
    assert kill.seconds == 41.23
    assert kill.reasons == {"served 'default' while the fleet held ['7']": 2, "stream cut: 1 of 16 tokens (length)": 1}
    assert kill.served == {"default": 2, "7": 1}
    assert (disk.sent, disk.passed) == (0, False)  # no rollout, and its action failed


def test_markdown_table(fleet):
    row = fleet.PhaseRow("disk", 7.1, 441, 441, 0, 0, 220, ["POST /pause 200 0.01s"], {}, {"7": 441}, True)
    bad = fleet.PhaseRow("kill-b", 40.0, 12, 6, 0, 6, 0, ["kill -9 worker B: exit 0"],
                         {"served 'default' while the fleet held ['7']": 6}, {"7": 6, "default": 6}, False)
    assert fleet.markdown([row, bad], "Fleet round").splitlines() == [
        "### Fleet round", "",
        "| phase | seconds | sent | ok | lost | served stale | mislabelled | refused | streamed | pass |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        "| disk | 7.10 | 441 | 441 | 0 | 0 | 0 | 0 | 220 | yes |",
        "| kill-b | 40.00 | 12 | 6 | 0 | 6 | 0 | 0 | 0 | NO |",
        "",
        "- **disk**: POST /pause 200 0.01s; versions served {'7': 441}",
        "- **kill-b**: kill -9 worker B: exit 0; versions served {'7': 6, 'default': 6}",
        "  - 6 x served 'default' while the fleet held ['7']"]


def test_phases_and_defaults(fleet):
    args = fleet.parse_args(["--proxy", "http://p", "--worker", "http://a", "--worker", "http://b", "--weights", "sim"])
    assert args.phases == ["steady", "nccl-primerl", "nccl-vllm", "failed-push", "join-wedge", "disk", "kill-b",
                           "nccl-after", "proxy-restart", "replica", "findings-2-3"]
    assert args.router is None and args.proxy_script == "bash tests/e2e/fleet_proxy.sh"
    assert (args.backend, args.device, args.after_kill_s) == ("nccl", None, 80.0)


def test_phases_that_start_proxies_need_the_router(fleet):
    base = ["--proxy", "http://p", "--worker", "http://a", "--weights", "sim"]
    with pytest.raises(SystemExit, match=r"--router is needed by the phases \['replica'\]"):
        fleet.main([*base, "--phases", "steady", "replica"])
    args = fleet.parse_args([*base, "--router", "http://r", "--phases", "proxy-restart", "findings-2-3"])
    assert (args.router, args.phases) == ("http://r", ["proxy-restart", "findings-2-3"])


def test_a_label_seen_on_other_weights_makes_its_replies_mislabelled(fleet):
    rollouts = [fleet.Rollout("findings-2-3", False, 0, 1, "ok", "", "other-5"),
                fleet.Rollout("findings-2-3", True, 0, 1, "ok", "", "disk-6"),
                fleet.Rollout("findings-2-3", False, 0, 1, "stale", "served 'other-5' while ...", "other-5"),
                fleet.Rollout("findings-2-3", False, 0, 1, "lost", "503: x", "other-5"),
                fleet.Rollout("findings-2-3", False, 0, 1, "refused", "503: no healthy SGLang worker", None),
                fleet.Rollout("replica", False, 0, 1, "ok", "", "other-5")]
    actions = {"findings-2-3": (1.0, [], True), "replica": (1.0, [], True)}
    row, replica = fleet.rows_of(["findings-2-3", "replica"], rollouts, actions, {"findings-2-3": {"other-5"}})
    assert (row.sent, row.ok, row.stale, row.mislabelled, row.refused, row.lost) == (5, 1, 0, 2, 1, 1)
    assert row.reasons["label 'other-5' on other weights"] == 1
    assert not row.passed
    assert (replica.ok, replica.mislabelled, replica.passed) == (1, 0, True)  # only the phase it was seen in
    refused_only = fleet.rows_of(["findings-2-3"], rollouts[1:2] + rollouts[4:5], actions)[0]
    assert (refused_only.ok, refused_only.refused, refused_only.passed) == (1, 1, True)


def test_fence_counts_read_from_metrics(fleet):
    text = ("# HELP token_proxy_fence_events_total Workers fenced\n# TYPE token_proxy_fence_events_total counter\n"
            'token_proxy_fence_events_total{event="fenced"} 1.0\n'
            'token_proxy_fence_events_total{event="healed"} 0.0\n'
            'token_proxy_fenced_workers{reason="x",url="http://b"} 1.0\n')
    assert fleet.fence_counts(text) == {"fenced": 1.0, "healed": 0.0}
    assert fleet.fence_counts("") == {}
