"""Session continuity (issue #16) at the store level: exact multi-turn ids for message-only clients.

A "model" here produces completion ids the way a sampler does — not the canonical BPE encoding of
its text — so re-rendering the conversation drifts, as tests/test_multiturn.py shows end to end.
"""

from __future__ import annotations

import copy

import pytest
from prometheus_client import CollectorRegistry

from tests.test_multiturn import EOS, THINKING_TEMPLATE
from token_proxy.sessions import (HEADER, RESPONSE_FIELD, Divergence, Fallback, SessionCollector, SessionOutcome,
                                  SessionStore, TemplateCodec)
from token_proxy.tokenization.renderer import ChatPrompt, render_chat_ids

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

    def __init__(self, tokenizer, store: SessionStore | None, key="rollout-1", tools=None, template=None):
        self.tokenizer, self.store, self.key = tokenizer, store, key
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
        plan = self.store.prompt_ids(self.key, copy.deepcopy(self.messages), TemplateCodec(self.tokenizer, self.prompt()))
        self.outcomes.append(plan.outcome)
        return plan.ids, plan

    def turn(self, user: dict | None, text: str, finish="stop", reply=None, returned=None):
        """One request: the model 'writes' `text`; the client appends `returned` (default: the reply)."""
        ids, plan = self.send(user)
        completion = sampled_ids(self.tokenizer, text) + ([EOS] if finish != "length" else [])
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
