"""Earlier assistant tool calls, made ready for the chat template (vLLM's _postprocess_messages).

OpenAI clients send `tool_calls[i].function.arguments` back as the JSON string they got;
chat templates expect a mapping (Transformers' convention). vLLM parses the string and
coerces what is not a JSON object to `{}` rather than failing every later turn.
"""

from __future__ import annotations

import copy
import json
import logging

from token_proxy.errors import InvalidRequest

log = logging.getLogger(__name__)


def messages_for_template(messages: list[dict]) -> list[dict]:
    """A copy of `messages` whose assistant tool-call arguments are dicts; empty tool_calls dropped."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if not isinstance(calls, list):
            out.append(message)
            continue
        message = dict(message)
        if calls:
            message["tool_calls"] = [_prepared(call) for call in calls]
        else:
            message.pop("tool_calls")
        out.append(message)
    return out


def _prepared(call: object) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict):
        raise InvalidRequest("assistant tool_calls entries must be objects.", param="tool_calls")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise InvalidRequest("chat completions only support assistant tool_calls of type 'function'.",
                             param="tool_calls")
    call = copy.copy(call)
    call["function"] = {**function, "arguments": _arguments(function.get("arguments"))}
    return call


def _arguments(raw: object) -> dict:
    if not raw:
        return {}
    if isinstance(raw, dict):
        return raw
    parsed = raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            log.warning("tool call arguments are not valid JSON (%d chars); using {}", len(raw))
            return {}
    return parsed if isinstance(parsed, dict) else {}
