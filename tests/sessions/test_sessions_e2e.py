"""Sessions through the openai client (issue #16), sending only messages.

Wiring expected: the chat endpoint reads `X-Session-ID` (or body `session_id`), builds its prompt ids with
`SessionStore.prompt_ids`, records the single choice it returned, and answers with the
`X-Session-Continuity` header and a top-level `session_continuity` field.
"""

from __future__ import annotations

import asyncio
import threading
import time
from itertools import pairwise

import openai

from tests.sessions.test_multiturn import EOS
from token_proxy.api.chat.sessions import SESSIONS

MODEL = "sim/qwen2-tiny"
SAMPLING = {"return_token_ids": True, "min_tokens": 12, "logit_bias": {str(EOS): 100}}


async def three_turns(client, session: str | None, seed: int):
    messages = [{"role": "user", "content": "Name a colour."}]
    turns = []
    for k, question in enumerate(["Another one?", "And a third?", "Thanks."]):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=40, temperature=1.0, seed=seed * 10 + k,
            extra_body=SAMPLING, extra_headers={"X-Session-ID": session} if session else None)
        r = raw.parse()
        turns.append((r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"],
                      raw.headers.get("X-Session-Continuity"), r.model_extra.get("session_continuity")))
        messages += [r.choices[0].message.model_dump(), {"role": "user", "content": question}]
    return turns


async def test_every_turn_extends_the_previous_prompt_and_completion(proxy):
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)
    drifted = 0
    for seed in range(5):
        with_session = await three_turns(client, f"rollout-{seed}", seed)
        for (prompt, completion, _, _), (following, _, header, field) in pairwise(with_session):
            assert following[:len(prompt) + len(completion)] == prompt + completion
            assert header == "hit" and field["status"] == "hit"
        assert with_session[0][2] == "fallback; reason=unknown_session"
        without = await three_turns(client, None, seed)
        assert without[0][2] is None and without[0][3] is None
        drifted += any(following[:len(p) + len(c)] != p + c
                       for (p, c, _, _), (following, _, _, _) in pairwise(without))
    assert drifted >= 1  # the same sampled turns re-rendered without a session break the prefix
    await client.close()


async def test_edited_history_is_reported(proxy):
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)
    headers = {"X-Session-ID": "edited"}
    messages = [{"role": "user", "content": "Name a colour."}]
    r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, extra_body=SAMPLING,
                                             extra_headers=headers)
    messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "Another one?"}]
    messages[0]["content"] = "Name a fruit."
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=16, extra_body=SAMPLING, extra_headers=headers)
    assert raw.headers["X-Session-Continuity"] == "fallback; reason=history_edited"
    assert raw.parse().model_extra["session_continuity"]["reason"] == "history_edited"
    await client.close()


async def test_streamed_turns_extend_too_and_say_so_before_the_first_byte(proxy):
    """Streaming: the header goes out with the SSE response, the field rides on the role chunk, and the
    turn is recorded from what was streamed."""
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    previous = None
    for k, question in enumerate(["Another one?", "And a third?"]):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=40, temperature=1.0, seed=k, stream=True,
            extra_body={**SAMPLING, "session_id": "streamed"})
        header = raw.headers["X-Session-Continuity"]
        chunks = [c async for c in raw.parse()]
        prompt = chunks[0].model_extra["prompt_token_ids"]
        field = chunks[0].model_extra["session_continuity"]
        assert field["status"] == header.split(";")[0]
        ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        if previous is None:
            assert header == "fallback; reason=unknown_session"
        else:
            assert header == "hit" and prompt[:len(previous)] == previous
            assert field["reused_tokens"] == len(previous)
        previous = prompt + ids
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": question}]
    await client.close()


async def test_tool_calls_inside_a_session(make_sim, make_proxy):
    """An agent loop (assistant tool_calls -> tool message) continues from the stored ids every turn."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    sim = await make_sim(scripted_output=call)
    proxy = await make_proxy(sim, enable_auto_tool_choice=True)  # hermes, from the template
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    previous = None
    for stream in (False, True, False):
        kwargs = {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 60,
                  "extra_body": {"return_token_ids": True}, "extra_headers": {"X-Session-ID": "agent"}}
        if stream:
            raw = await client.chat.completions.with_raw_response.create(stream=True, **kwargs)
            chunks = [c async for c in raw.parse()]
            prompt = chunks[0].model_extra["prompt_token_ids"]
            ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
            deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
            calls = [{"id": deltas[0].id, "type": "function", "function": {
                "name": deltas[0].function.name, "arguments": "".join(d.function.arguments or "" for d in deltas)}}]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) or None
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            raw = await client.chat.completions.with_raw_response.create(**kwargs)
            r = raw.parse()
            prompt, ids = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
            calls = [c.model_dump() for c in r.choices[0].message.tool_calls]
            content = r.choices[0].message.content
            assert r.choices[0].finish_reason == "tool_calls"
        header = raw.headers["X-Session-Continuity"]
        assert header == ("fallback; reason=unknown_session" if previous is None else "hit")
        if previous is not None:
            assert prompt[:len(previous)] == previous
        previous = prompt + ids
        messages += [{"role": "assistant", "content": content, "tool_calls": calls},
                     {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}]
    await client.close()


async def test_truncated_turn_and_eviction_and_metrics(make_sim, make_proxy):
    sim = await make_sim()
    proxy = await make_proxy(sim, session_max_count=1)
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)

    async def turn(session, messages, max_tokens=40):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, extra_body=SAMPLING,
            extra_headers={"X-Session-ID": session})
        r = raw.parse()
        return raw.headers["X-Session-Continuity"], r

    messages = [{"role": "user", "content": "Count to a hundred."}]
    header, r = await turn("a", messages, max_tokens=13)
    assert r.choices[0].finish_reason == "length"
    messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "Go on."}]
    header, r = await turn("a", messages)
    # ChatML renders a truncated turn verbatim: continued, with the template's close appended
    assert header == "hit", header
    header, _ = await turn("b", [{"role": "user", "content": "hi"}])  # count bound 1: "a" is evicted
    messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "More."}]
    header, _ = await turn("a", messages)
    assert header == "fallback; reason=unknown_session"
    metrics = await (await proxy.get("/metrics")).text()
    assert "token_proxy_session_hits_total 1.0" in metrics
    assert 'token_proxy_session_evictions_total{cause="lru"} 2.0' in metrics
    assert 'token_proxy_session_fallbacks_total{reason="unknown_session"} 3.0' in metrics
    await client.close()


async def test_session_keys_are_checked_and_ignored_where_they_cannot_apply(make_sim, make_proxy):
    sim = await make_sim()
    proxy = await make_proxy(sim)
    user = [{"role": "user", "content": "hi"}]
    resp = await proxy.post("/v1/chat/completions", json={"messages": user, "session_id": 5, "max_tokens": 2})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "session_id"
    # truncate_prompt_tokens: the prompt is not the rendered messages; full render, reported
    resp = await proxy.post("/v1/chat/completions", json={"messages": user, "session_id": "t", "max_tokens": 2,
                                                          "truncate_prompt_tokens": 3})
    assert resp.headers["X-Session-Continuity"] == "fallback; reason=unsupported_request"
    # no key: neither the header nor the field
    resp = await proxy.post("/v1/chat/completions", json={"messages": user, "max_tokens": 2})
    assert "X-Session-Continuity" not in resp.headers and "session_continuity" not in await resp.json()
    # n > 1: planned, never recorded (the next turn cannot know which choice the client kept)
    resp = await proxy.post("/v1/chat/completions", json={"messages": user, "session_id": "n", "max_tokens": 2,
                                                          "n": 2})
    assert resp.headers["X-Session-Continuity"] == "fallback; reason=unknown_session"
    assert len(proxy.server.app[SESSIONS]) == 0
    # sessions off: keys ignored
    off = await make_proxy(sim, session_max_bytes=0)
    resp = await off.post("/v1/chat/completions", json={"messages": user, "session_id": "x", "max_tokens": 2})
    assert resp.status == 200 and "X-Session-Continuity" not in resp.headers


async def test_turn_two_sent_as_soon_as_turn_one_streamed_still_continues(proxy):
    """A stream's turn is recorded after its last chunk, in the tokenizer executor: the next lookup on the
    session waits for it. The record is slowed down here so that turn 2 arrives while it is under way."""
    store = proxy.server.app[SESSIONS]
    record, threads = store.record, []

    def slow_record(*args):
        threads.append(threading.current_thread())
        time.sleep(0.5)
        record(*args)

    store.record = slow_record
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stream=True,
                                                  extra_body={**SAMPLING, "session_id": "eager"})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Another one?"}]
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=16, extra_body=SAMPLING, extra_headers={"X-Session-ID": "eager"})
    assert raw.headers["X-Session-Continuity"] == "hit"
    assert threads[0] is not threading.main_thread()  # turn 1's record ran (first), off the event loop
    await client.close()


async def test_skyrl_finish_session_drops_the_turn_now(proxy):
    """SkyRL's RemoteInferenceClient.finish_session: POST /finish_session?session_id=ID at a trajectory's end
    (issue 31). The next turn of that session starts afresh; unknown ids are a no-op, as SkyRL expects."""
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, extra_body=SAMPLING,
                                             extra_headers={"X-Session-ID": "traj-1"})
    store = proxy.app[SESSIONS]
    for _ in range(100):  # recorded in the tokenizer executor after the reply
        if len(store) == 1:
            break
        await asyncio.sleep(0.01)
    assert len(store) == 1
    response = await proxy.post("/finish_session", params={"session_id": "traj-1"})
    assert (response.status, await response.json()) == (200, {"session_id": "traj-1", "finished": True})
    assert len(store) == 0
    response = await proxy.post("/finish_session", params={"session_id": "never-seen"})
    assert (response.status, await response.json()) == (200, {"session_id": "never-seen", "finished": False})
    response = await proxy.post("/finish_session")
    assert response.status == 400 and (await response.json())["error"]["param"] == "session_id"
    messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "Another one?"}]
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=16, extra_body=SAMPLING, extra_headers={"X-Session-ID": "traj-1"})
    assert raw.headers["X-Session-Continuity"] == "fallback; reason=unknown_session"
    await client.close()


async def test_fetch_weights_is_a_501_that_says_how_weights_reach_sglang(proxy):
    response = await proxy.post("/fetch_weights", json={})
    body = await response.json()
    assert response.status == 501
    assert body["error"]["type"] == "NotImplementedError" and "/update_weights" in body["error"]["message"]
