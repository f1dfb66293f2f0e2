"""POST /v1/chat/completions, /v1/chat/completions/tokens and /v1/chat/completions/render: the chat
request (request.py), its endpoint adapter of the pipeline (endpoint.py), vLLM's body and chunks
(format.py), render's reply (render.py) and session continuity's hook (sessions.py)."""

from token_proxy.faces import door

__all__ = [
    "ChatRequest", "chat_completions", "chat_completions_render", "chat_completions_tokens",
    "parse_chat_request",
]

__getattr__ = door(__name__, {
    "ChatRequest": "request",
    "chat_completions": "endpoint",
    "chat_completions_render": "endpoint",
    "chat_completions_tokens": "endpoint",
    "parse_chat_request": "request",
})
