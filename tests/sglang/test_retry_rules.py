"""The one retry list (sglang/retry_rules.py): pure rules in order, and the one retry point that applies them."""

from __future__ import annotations

import aiohttp
import pytest

from token_proxy.errors import BackendError, BackendUnavailable, InvalidRequest, ReplyBrokeOff
from token_proxy.sglang import retry_rules
from token_proxy.sglang.retry_rules import RULES, Attempt, Call, Outcome, again_because, retrying


def _attempt(reused: bool = False, answered: bool = False) -> Attempt:
    attempt = Attempt()
    attempt.reused, attempt.answered = reused, answered
    return attempt


def _unreachable(cause: BaseException) -> BackendUnavailable:
    error = BackendUnavailable(f"SGLang at x is unreachable: {cause}")
    error.__cause__ = cause
    return error


class _Reload:
    async def resync(self) -> None:
        return None


LOST = InvalidRequest("SGLang rejected the request: The following requested LoRA adapters are not loaded: a@v1")


def test_the_list_is_in_its_documented_order():
    assert [rule.__name__ for rule in RULES] == ["broken_reply", "lost_adapter", "stale_connection", "stale_weights"]


@pytest.mark.parametrize(("outcome", "call", "reason"), [
    # a broken reply on a reused connection: the first rule wins (generated again), never "stale"
    (Outcome(_attempt(reused=True), ReplyBrokeOff("closed mid-response")), Call(regenerates=True), "broken_reply"),
    (Outcome(_attempt(reused=True), ReplyBrokeOff("closed mid-response")), Call(), None),
    (Outcome(_attempt(), LOST), Call(reload=_Reload()), "lost adapter"),
    (Outcome(_attempt(), LOST), Call(), None),  # no reload: SGLang's 400 is the client's
    (Outcome(_attempt(reused=True), _unreachable(aiohttp.ServerDisconnectedError())), Call(), "disconnected"),
    (Outcome(_attempt(reused=True), _unreachable(ConnectionResetError(104, "reset"))), Call(), "reset"),
    (Outcome(_attempt(reused=False), _unreachable(aiohttp.ServerDisconnectedError())), Call(), None),  # new one
    (Outcome(_attempt(reused=True, answered=True), _unreachable(aiohttp.ServerDisconnectedError())), Call(), None),
    (Outcome(_attempt(reused=True), BackendError("SGLang failed with HTTP 500: x")), Call(), None),  # its own answer
    (Outcome(_attempt(), stale="SGLang answered from weight version 'b'"), Call(), "stale weights"),
    (Outcome(_attempt()), Call(), None),
])
def test_each_outcome_gets_the_first_rules_reason(outcome, call, reason):
    assert again_because(outcome, call) == reason


class _Check:
    def __init__(self, tries: int, stale_sends: int):
        self.tries, self.left, self.judged = tries, stale_sends, 0

    def fresh(self, versions: set[str]) -> bool:
        return versions == {"current"}

    async def stale(self, versions: set[str], since: float) -> str | None:
        self.judged += 1
        return "SGLang answered from weight version 'rogue' while the fleet serves 'current'"


async def test_a_stale_reply_is_sent_again_up_to_the_tries_then_a_503(monkeypatch):
    monkeypatch.setattr(retry_rules, "STALE_BACKOFF_S", 0.0)
    sends, discarded = [], []
    check = _Check(tries=3, stale_sends=3)

    async def send(again: bool) -> list[dict]:
        sends.append(again)
        return [{"meta_info": {"weight_version": "rogue"}}]

    async def discard(reply) -> None:
        discarded.append(reply)

    with pytest.raises(BackendUnavailable, match=r"^SGLang answered from weight version 'rogue' while the fleet serves "
                                                 r"'current', 3 time\(s\): a worker is out of step with the fleet"):
        await retrying(send, Call(check=check), versions_of=lambda items: {"rogue"}, discard=discard)
    assert (sends, len(discarded), check.judged) == ([False, False, False], 3, 3)  # through the pool, not forced new


async def test_a_stale_reply_then_a_current_one_returns_the_current_one(monkeypatch):
    monkeypatch.setattr(retry_rules, "STALE_BACKOFF_S", 0.0)
    replies = [{"rogue"}, {"current"}]

    async def send(again: bool) -> set[str]:
        return replies.pop(0)

    assert await retrying(send, Call(check=_Check(tries=3, stale_sends=1)), versions_of=lambda v: v) == {"current"}


async def test_a_failure_is_sent_again_once_per_call():
    sends, retried = [], []

    async def send(again: bool):
        sends.append(again)
        raise ReplyBrokeOff("SGLang closed the connection mid-response: x")

    with pytest.raises(ReplyBrokeOff):
        await retrying(send, Call(regenerates=True), on_retry=retried.append)
    assert (sends, retried) == ([False, True], ["broken_reply"])
