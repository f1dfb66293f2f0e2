"""Session continuity (issue #16) at the store level: exact multi-turn ids for message-only clients.

A "model" here produces completion ids the way a sampler does — not the canonical BPE encoding of
its text — so re-rendering the conversation drifts, as tests/sessions/test_multiturn.py shows end to end.
"""

from __future__ import annotations

import copy

import pytest
from prometheus_client import CollectorRegistry

from tests.sessions.test_multiturn import EOS, THINKING_TEMPLATE
from token_proxy.api.messages import parse_messages
from token_proxy.sessions import (
    HEADER,
    RESPONSE_FIELD,
    Divergence,
    Fallback,
    SessionCollector,
    SessionOutcome,
    SessionStore,
    TemplateCodec,
)
from token_proxy.tokenization import ChatPrompt
from token_proxy.tokenization.renderer import render_chat_ids, render_chat_text

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def sampled_ids(tokenizer, text: str) -> list[int]:
    """Ids a sampler could emit for `text`: pieces of 3 characters, each encoded alone (not BPE-canonical)."""
    ids = [i for k in range(0, len(text), 3) for i in tokenizer.encode(text[k:k + 3])]
    assert tokenizer.decode(ids) == text
    return ids


class Conversation:
    """A client that sends only messages, and the proxy's prompt step with or without a session."""

    def __init__(self, tokenizer, store: SessionStore | None, key="rollout-1", tools=None, template=None,
                 model_tokenizer=None):
        self.tokenizer, self.store, self.key = tokenizer, store, key
        self.model_tokenizer = model_tokenizer or tokenizer
        self.tools, self.template = tools, template
        self.messages: list[dict] = []
        self.turns: list[tuple[list[int], list[int]]] = []  # (prompt ids, completion ids)
        self.outcomes: list[SessionOutcome] = []

    def prompt(self) -> ChatPrompt:
        return ChatPrompt(messages=self.messages, tools=self.tools, chat_template=self.template)

    def send(self, message: dict | None = None):
        if message is not None:
            self.messages.append(message)
        if self.store is None:
            return list(render_chat_ids(self.tokenizer, self.prompt())), None
        messages = parse_messages(copy.deepcopy(self.messages))  # as the chat path hands them over
        plan = self.store.prompt_ids(self.key, messages, TemplateCodec(self.tokenizer, self.prompt()))
        self.outcomes.append(plan.outcome)
        return plan.ids, plan

    def turn(self, user: dict | None, text: str, finish="stop", reply=None, returned=None):
        """One request: the model 'writes' `text`; the client appends `returned` (default: the reply)."""
        ids, plan = self.send(user)
        completion = sampled_ids(self.model_tokenizer, text) + ([EOS] if finish != "length" else [])
        reply = reply or {"role": "assistant", "content": text}
        if plan is not None:
            self.store.record(plan, completion, finish, reply)
        self.turns.append((ids, completion))
        self.messages.append(returned or reply)
        return ids


def user(text):
    return {"role": "user", "content": text}


def test_three_turns_extend_the_previous_prompt_and_completion_exactly(hf_tokenizer):
    store = SessionStore()
    chat = Conversation(hf_tokenizer, store)
    chat.turn(user("Name a colour."), "Blueberry-ish turquoise, honestly.")
    chat.turn(user("Another one?"), "Vermilion, or maybe periwinkle.")
    chat.turn(user("And a third?"), "Chartreuse.")
    ids4, _ = chat.send(user("Thanks!"))
    prompts = [p for p, _ in chat.turns] + [ids4]
    for (prompt, completion), following in zip(chat.turns, prompts[1:]):
        assert following[:len(prompt) + len(completion)] == prompt + completion
    # Only the new text is tokenized, and it is exactly the text the template adds after <|im_end|>:
    assert ids4[len(prompts[2]) + len(chat.turns[2][1]):] == hf_tokenizer.encode(
        "\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    assert [o.header_value() for o in chat.outcomes] == [
        "fallback; reason=unknown_session", "hit", "hit", "hit"]
    assert chat.outcomes[3].reused_tokens == len(prompts[2]) + len(chat.turns[2][1])
    assert store.stats.hits == 3 and store.stats.fallbacks == {"unknown_session": 1}


def test_without_a_session_the_same_conversation_drifts(hf_tokenizer):
    chat = Conversation(hf_tokenizer, None)
    chat.turn(user("Name a colour."), "Blueberry-ish turquoise, honestly.")
    ids2 = chat.turn(user("Another one?"), "Vermilion, or maybe periwinkle.")
    prompt1, completion1 = chat.turns[0]
    assert ids2[:len(prompt1)] == prompt1
    assert ids2[:len(prompt1) + len(completion1)] != prompt1 + completion1  # re-tokenized: drift
    assert hf_tokenizer.decode(ids2[:len(prompt1) + len(completion1)]).startswith(
        hf_tokenizer.decode(prompt1 + completion1))  # same text, other ids


def test_template_that_drops_past_reasoning_keeps_the_model_ids_and_reports_it(hf_tokenizer):
    store = SessionStore()
    chat = Conversation(hf_tokenizer, store, template=THINKING_TEMPLATE)
    chat.turn(user("Name a colour."), "<think>\nRed or blue?\n</think>\n\nBlue.")
    ids2 = chat.turn(user("Another one?"), "<think>\nHmm.\n</think>\n\nGreen.")
    ids3, _ = chat.send(user("More?"))
    (p1, c1), (p2, c2) = chat.turns
    assert ids2[:len(p1) + len(c1)] == p1 + c1 and ids3[:len(p2) + len(c2)] == p2 + c2
    assert ids3[len(p2) + len(c2):] == hf_tokenizer.encode(
        "\n<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\n")
    assert [o.header_value() for o in chat.outcomes[1:]] == ["hit; divergence=assistant_rerendered"] * 2
    assert chat.outcomes[1].as_field() == {"status": "hit", "reason": None, "divergence": "assistant_rerendered",
                                           "reused_tokens": len(p1) + len(c1), "new_tokens": len(ids2) - len(p1) - len(c1)}
    # A fresh render of the same messages has no <think> block in turn 1: the trainer is told so.
    fresh = list(render_chat_ids(hf_tokenizer, chat.prompt()))
    assert fresh[:len(p1) + len(c1)] != p1 + c1
    assert store.stats.divergent_hits == 2


def tool_call(arguments: str, call_id="call_1"):
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def as_openai_client_returns_it(message: dict) -> dict:
    """`ChatCompletionMessage.model_dump()`: every optional field present, mostly null."""
    return {"content": None, "refusal": None, "role": "assistant", "annotations": None, "audio": None,
            "function_call": None, "tool_calls": None, "reasoning": None, **message}


@pytest.mark.parametrize("model_json, divergence", [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None),  # as the template writes it
    ('{"name":"get_weather","arguments":{"city":"Paris"}}', Divergence.ASSISTANT_RERENDERED),
])
def test_tool_calls_and_tool_messages_continue_the_session(hf_tokenizer, model_json, divergence):
    store = SessionStore()
    chat = Conversation(hf_tokenizer, store, tools=TOOLS)
    reply = {"role": "assistant", "content": "", "tool_calls": [tool_call('{"city": "Paris"}')]}
    chat.turn(user("Weather in Paris?"), f"<tool_call>\n{model_json}\n</tool_call>", reply=reply,
              returned=as_openai_client_returns_it({"tool_calls": [tool_call('{"city": "Paris"}')]}))
    chat.turn({"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}, "It is 21°C, sunny-ish.")
    ids3, _ = chat.send(user("Thanks."))
    (p1, c1), (p2, c2) = chat.turns
    assert p2[:len(p1) + len(c1)] == p1 + c1 and ids3[:len(p2) + len(c2)] == p2 + c2
    assert p2[len(p1) + len(c1):] == hf_tokenizer.encode(
        '\n<|im_start|>user\n<tool_response>\n{"celsius": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    assert [o.divergence for o in chat.outcomes[1:]] == [divergence, None]
    assert [o.status for o in chat.outcomes] == ["fallback", "hit", "hit"]


def test_a_truncated_turn_is_continued_with_the_templates_close(hf_tokenizer):
    chat = Conversation(hf_tokenizer, SessionStore())
    chat.turn(user("Name a colour."), "Blueberry-ish turquoise, hon", finish="length")
    ids2, _ = chat.send(user("Go on."))
    p1, c1 = chat.turns[0]
    assert c1[-1] != EOS and ids2[:len(p1) + len(c1)] == p1 + c1
    assert ids2[len(p1) + len(c1):] == hf_tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n")
    assert chat.outcomes[1].header_value() == "hit"


def test_a_truncated_turn_that_the_template_rewrites_falls_back(hf_tokenizer):
    chat = Conversation(hf_tokenizer, SessionStore(), template=THINKING_TEMPLATE)
    chat.turn(user("Name a colour."), "<think>\nRed or blue?\n</think>\n\nBlu", finish="length")
    chat.send(user("Go on."))
    assert chat.outcomes[1].header_value() == "fallback; reason=truncated_turn"


def two_turns(hf_tokenizer, store, **kw) -> Conversation:
    chat = Conversation(hf_tokenizer, store, **kw)
    chat.turn({"role": "system", "content": "Be brief."}, "Okay.")
    chat.turn(user("Name a colour."), "Blueberry-ish turquoise.")
    return chat


@pytest.mark.parametrize("edit, reason", [
    (lambda m: m[0].update(content="Be verbose."), Fallback.HISTORY_EDITED),
    (lambda m: m[2].update(content="Name a fruit."), Fallback.HISTORY_EDITED),
    (lambda m: m[3].update(content="Red."), Fallback.ASSISTANT_EDITED),
    (lambda m: m.insert(4, {"role": "assistant", "content": "And green."}), Fallback.NEW_ASSISTANT_MESSAGE),
    (lambda m: m.pop(3), Fallback.NOT_AN_EXTENSION),
    (lambda m: m.pop(), Fallback.NOT_AN_EXTENSION),  # the same turn re-sent (a retry)
])
def test_edited_history_falls_back_with_a_reason(hf_tokenizer, edit, reason):
    store = SessionStore()
    chat = two_turns(hf_tokenizer, store)
    chat.messages.append(user("Another one?"))
    edit(chat.messages)
    ids, _ = chat.send()
    assert chat.outcomes[-1] == SessionOutcome.fallback(reason, len(ids))
    assert ids == list(render_chat_ids(hf_tokenizer, chat.prompt()))  # today's full render
    assert store.stats.fallbacks[reason.value] == 1


def test_changed_tools_or_template_fall_back(hf_tokenizer):
    store = SessionStore()
    chat = two_turns(hf_tokenizer, store)
    chat.tools = TOOLS
    chat.send(user("Another one?"))
    chat.tools, chat.template = None, THINKING_TEMPLATE
    chat.send()
    assert [o.reason for o in chat.outcomes[-2:]] == [Fallback.TOOLS_CHANGED, Fallback.TEMPLATE_CHANGED]


def test_the_returned_message_may_come_back_in_another_shape(hf_tokenizer):
    """model_dump() nulls, `reasoning` renamed `reasoning_content`, text parts: same as the template sees it."""
    chat = Conversation(hf_tokenizer, SessionStore())
    text = "Blueberry-ish\nturquoise."
    chat.turn(user("Name a colour."), text, reply={"role": "assistant", "content": text, "reasoning": "Hm."},
              returned=as_openai_client_returns_it({"reasoning": None, "reasoning_content": "Hm.", "content": [
                  {"type": "text", "text": "Blueberry-ish"}, {"type": "text", "text": "turquoise."}]}))
    chat.send(user("Another one?"))
    assert chat.outcomes[1].header_value() == "hit"


def test_unknown_session_and_unsupported_requests(hf_tokenizer):
    store = SessionStore()
    two_turns(hf_tokenizer, store, key="a")
    chat = Conversation(hf_tokenizer, store, key="b")  # another worker's session looks like this
    chat.messages = two_turns(hf_tokenizer, None).messages
    chat.send(user("Another one?"))
    assert chat.outcomes[0].reason is Fallback.UNKNOWN_SESSION
    prompt = ChatPrompt(messages=[user("Hi")], continue_final_message=True, add_generation_prompt=False)
    plan = store.prompt_ids("a", [user("Hi")], TemplateCodec(hf_tokenizer, prompt))
    assert plan.outcome.reason is Fallback.UNSUPPORTED_REQUEST and plan.rendering is None


def test_an_assistant_message_that_renders_the_same_is_the_same(hf_tokenizer):
    """The client dropped the reasoning the proxy returned; this template never renders it anyway."""
    chat = Conversation(hf_tokenizer, SessionStore())
    chat.turn(user("Name a colour."), "Blue.", reply={"role": "assistant", "content": "Blue.", "reasoning": "Hm."},
              returned={"role": "assistant", "content": "Blue."})
    chat.send(user("Another one?"))
    assert chat.outcomes[1].header_value() == "hit"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def record_turn(store, hf_tokenizer, key, text="Blue."):
    chat = Conversation(hf_tokenizer, store, key=key)
    chat.turn(user("Name a colour."), text)
    return chat


def test_eviction_by_count_ttl_and_bytes(hf_tokenizer):
    clock = Clock()
    store = SessionStore(max_sessions=2, ttl_s=60, clock=clock)
    a, b = record_turn(store, hf_tokenizer, "a"), record_turn(store, hf_tokenizer, "b")
    a.send(user("More?"))  # a is now the most recently used
    record_turn(store, hf_tokenizer, "c")
    b.send(user("More?"))
    assert b.outcomes[-1].reason is Fallback.UNKNOWN_SESSION and a.outcomes[-1].header_value() == "hit"
    assert store.stats.evictions == {"lru": 1} and len(store) == 2

    clock.now = 61
    a.send()
    assert a.outcomes[-1].reason is Fallback.UNKNOWN_SESSION and store.stats.evictions["ttl"] == 1
    record_turn(store, hf_tokenizer, "d")  # recording sweeps the other expired session ("c")
    assert store.stats.evictions["ttl"] == 2 and len(store) == 1

    one_turn = store.nbytes
    small = SessionStore(max_bytes=int(one_turn * 2.5))
    for key in "xyz":
        record_turn(small, hf_tokenizer, key)
    assert small.stats.evictions == {"bytes": 1} and len(small) == 2 and small.nbytes <= small.max_bytes
    record_turn(small, hf_tokenizer, "huge", text="word " * 2000)  # larger than the whole budget
    assert small.stats.evictions == {"bytes": 2} and len(small) == 2 and "huge" not in small._turns


class CountingTokenizer:
    """The tokenizer, counting what gets encoded (renders and decodes are not tokenization)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.encoded: list[int] = []  # characters per encode call

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_only_the_new_messages_are_tokenized_at_turn_k(hf_tokenizer):
    counting = CountingTokenizer(hf_tokenizer)
    chat = Conversation(counting, SessionStore(), model_tokenizer=hf_tokenizer)
    question = user("And one more colour, please?")
    chat.turn(question, "Blue.")
    per_turn = []
    for k in range(12):
        counting.encoded.clear()
        chat.turn(dict(question), f"Colour number {k} is a long and winding answer. " * 20)
        per_turn.append(counting.encoded[:])
    suffix = "\n<|im_start|>user\nAnd one more colour, please?<|im_end|>\n<|im_start|>assistant\n"
    assert per_turn == [[len(suffix)]] * 12  # one encode call per turn, of the new text only
    assert all(o.header_value() == "hit" for o in chat.outcomes[1:])
    assert len(chat.turns[-1][0]) > 12 * 200  # while the history grew past 2,400 tokens


def test_collector_and_outcome_wire_formats(hf_tokenizer):
    store = SessionStore()
    chat = Conversation(hf_tokenizer, store)
    chat.turn(user("Name a colour."), "Blue.")
    chat.turn(user("Another one?"), "Red.")
    registry = CollectorRegistry()
    registry.register(SessionCollector(store))
    sample = registry.get_sample_value
    assert sample("token_proxy_session_hits_total") == 1
    assert sample("token_proxy_session_fallbacks_total", {"reason": "unknown_session"}) == 1
    assert sample("token_proxy_session_active") == 1 and sample("token_proxy_session_bytes") == store.nbytes
    assert (HEADER, RESPONSE_FIELD) == ("X-Session-Continuity", "session_continuity")
    assert SessionOutcome.fallback(Fallback.HISTORY_EDITED, 7).as_field() == {
        "status": "fallback", "reason": "history_edited", "divergence": None, "reused_tokens": 0, "new_tokens": 7}


# Qwen3's rule: assistant turns before the last user query lose their <think> block.
QWEN3_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set c = m['content'] or '' %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_query %}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_tool_cycle_whose_reasoning_the_template_drops_later_keeps_the_model_ids(hf_tokenizer):
    store = SessionStore()
    chat = Conversation(hf_tokenizer, store, template=QWEN3_LIKE_TEMPLATE)
    chat.turn(user("What is 6 x 7?"), "<think>\nUse the tool.\n</think>\n\nCalling calc.")
    chat.turn({"role": "tool", "content": "42"}, "<think>\nDone.\n</think>\n\nIt is 42.")
    ids3, _ = chat.send(user("And 6 x 8?"))  # a new query: both earlier turns lose <think> when rendered
    (p1, c1), (p2, c2) = chat.turns
    assert p2[:len(p1) + len(c1)] == p1 + c1 and ids3[:len(p2) + len(c2)] == p2 + c2
    assert ids3[len(p2) + len(c2):] == hf_tokenizer.encode(
        "\n<|im_start|>user\nAnd 6 x 8?<|im_end|>\n<|im_start|>assistant\n")
    assert [o.header_value() for o in chat.outcomes] == [
        "fallback; reason=unknown_session", "hit", "hit; divergence=history_rerendered"]
    chat.messages[0]["content"] = "What is 6 x 9?"  # a real edit is still told apart
    chat.send()
    assert chat.outcomes[-1].reason is Fallback.HISTORY_EDITED


async def test_session_key_from_header_or_body_and_the_executor_path(hf_tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    from token_proxy.errors import InvalidRequest
    from token_proxy.sessions import session_key

    assert session_key({"X-Session-ID": "h"}, {"session_id": "b"}) == "h"
    assert session_key({}, {"session_id": "b"}) == "b"
    assert session_key({}, {}) is None and session_key({}, {"session_id": ""}) is None
    for body in ({"session_id": 7}, {"session_id": "x" * 257}):
        with pytest.raises(InvalidRequest) as err:
            session_key({}, body)
        assert err.value.param == "session_id"
    store = SessionStore()
    prompt = ChatPrompt(messages=[user("Hi")])
    with ThreadPoolExecutor(1) as pool:
        plan = await store.prompt_ids_async(pool, "k", [user("Hi")], TemplateCodec(hf_tokenizer, prompt))
    assert plan.ids == list(render_chat_ids(hf_tokenizer, prompt))


def test_a_render_the_session_logic_asks_for_itself_never_fails_the_request(hf_tokenizer):
    """The stored reply has content null, which this template cannot render: that is a mismatch, not a 400."""
    chat = Conversation(hf_tokenizer, SessionStore(), template=THINKING_TEMPLATE)
    chat.turn(user("Weather?"), "Calling.", reply={"role": "assistant", "content": None, "tool_calls": [tool_call("{}")]},
              returned={"role": "assistant", "content": "", "tool_calls": [tool_call("{}", call_id="call_9")]})
    ids, _ = chat.send(user("Well?"))
    assert chat.outcomes[1].reason is Fallback.ASSISTANT_EDITED
    assert ids == list(render_chat_ids(hf_tokenizer, chat.prompt()))


def test_a_session_encodes_with_the_renderers_encoder(hf_tokenizer):
    """A session's new text is encoded by the encoder the renderer uses (the proven tiktoken twin where it
    applies), not the tokenizer's slower encode; the ids are the same either way."""
    calls = []

    def encoder(text: str, add_special_tokens: bool) -> list[int]:
        calls.append((text, add_special_tokens))
        return hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    prompt = ChatPrompt([user("Hi")])
    store = SessionStore()
    plain = store.prompt_ids("a", [user("Hi")], TemplateCodec(hf_tokenizer, prompt)).ids
    via = SessionStore().prompt_ids("a", [user("Hi")], TemplateCodec(hf_tokenizer, prompt, encoder)).ids
    assert via == plain
    assert calls == [(render_chat_text(hf_tokenizer, prompt), False)]
