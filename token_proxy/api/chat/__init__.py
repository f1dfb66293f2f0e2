"""POST /v1/chat/completions, /v1/chat/completions/tokens and /v1/chat/completions/render: the chat
request (request.py), its endpoint adapter of the pipeline (endpoint.py), vLLM's body and chunks
(format.py), render's reply (render.py) and session continuity's hook (sessions.py)."""

from token_proxy.api.chat.endpoint import chat_completions, chat_completions_render, chat_completions_tokens
from token_proxy.api.chat.request import ChatRequest, parse_chat_request

__all__ = [
    "ChatRequest", "chat_completions", "chat_completions_render", "chat_completions_tokens",
    "parse_chat_request",
]
