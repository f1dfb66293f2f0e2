"""The three text operations a session needs, bound to one request's rendering settings.

The session logic is template-generic: it only renders (Jinja, as the chat path does), encodes text
and decodes ids. `TemplateCodec` binds them to a tokenizer and a `ChatPrompt` (tools, template,
template kwargs, documents), so the rendering is exactly the chat path's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Protocol

import orjson

from token_proxy.tokenization.renderer import ChatPrompt, render_chat_text


class ChatCodec(Protocol):
    supported: bool  # False for requests that do not open a new assistant turn (continue_final_message)
    tools_key: bytes  # digest of the tools
    template_key: bytes  # digest of everything else that changes the rendering
    add_special_tokens: bool

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str: ...

    def render_requested(self, messages: list[dict]) -> str: ...  # with the request's own prompt flags

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...  # special tokens kept

    def special_text(self, token_id: int) -> str | None: ...  # the text of a special token, else None


class TemplateCodec:
    def __init__(self, tokenizer, prompt: ChatPrompt, encoder: Callable[[str, bool], list[int]] | None = None):
        """`encoder`: the renderer's (`PromptRenderer.encoder`: the proven tiktoken twin where it applies),
        so a session's ids are encoded as the same chat's are without one; else `tokenizer.encode`."""
        self.tokenizer = tokenizer
        self._encoder = encoder
        self.prompt = prompt
        self.tools_key = digest_json(prompt.tools)
        self.template_key = digest_json([prompt.documents, prompt.chat_template, prompt.chat_template_kwargs,
                                         prompt.add_special_tokens])
        self.add_special_tokens = prompt.add_special_tokens
        self.supported = prompt.add_generation_prompt and not prompt.continue_final_message

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        prompt = dataclasses.replace(self.prompt, messages=messages, add_generation_prompt=add_generation_prompt)
        return render_chat_text(self.tokenizer, prompt)

    def render_requested(self, messages: list[dict]) -> str:
        return render_chat_text(self.tokenizer, dataclasses.replace(self.prompt, messages=messages))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._encoder is not None:
            return self._encoder(text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def special_text(self, token_id: int) -> str | None:
        added = self.tokenizer.added_tokens_decoder.get(token_id)
        return added.content if added is not None and added.special else None


def digest_json(value) -> bytes:
    blob = orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.blake2b(blob, digest_size=16).digest()


def digest_text(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
