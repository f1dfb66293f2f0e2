"""Message equality that ignores what a chat template cannot see.

A client sends back the assistant message the proxy returned, but rarely byte-for-byte: the openai
client's `model_dump()` adds `refusal`/`audio`/... as null, agents rename `reasoning` to
`reasoning_content`, tool-call arguments come back as a JSON string or a dict. None of that changes
how the turn renders, so none of it breaks a session.
"""

from __future__ import annotations

import orjson

_REASONING_KEYS = ("reasoning_content", "reasoning")


def normalized(message: dict) -> dict:
    """The message as a template reads it: null/empty fields dropped, one reasoning key, parsed args."""
    out: dict = {}
    for key, value in message.items():
        if value is None or value == [] or key in _REASONING_KEYS:
            continue
        out[key] = _content_text(value) if key == "content" else value
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k)), None)
    if reasoning:
        out["reasoning_content"] = reasoning
    if out.get("content") == "":
        del out["content"]
    if "tool_calls" in out:
        out["tool_calls"] = [_tool_call(call) for call in out["tool_calls"]]
    return out


def same_message(a: dict, b: dict) -> bool:
    return normalized(a) == normalized(b)


def _content_text(content):
    """OpenAI's list-of-text-parts form equals the joined string (the chat parser joins it so, as vLLM)."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "\n".join(p.get("text", "") for p in content)
    return content


def _tool_call(call) -> dict:
    if not isinstance(call, dict):
        return call
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            pass
    return {"id": call.get("id"), "type": call.get("type", "function"), "function": function}
