"""Where a request names its session: the `X-Session-ID` header (what verifiers' clients send on
every provider request, verifiers/v1/clients/client.py) or a `session_id` body field (for clients that
cannot set headers; the openai client sends it through `extra_body`). The header wins."""

from __future__ import annotations

from collections.abc import Mapping

from token_proxy.errors import InvalidRequest
from token_proxy.ids import MAX_ID_CHARS

SESSION_ID_HEADER = "X-Session-ID"
SESSION_ID_FIELD = "session_id"


def session_key(headers: Mapping[str, str], body: dict) -> str | None:
    key = headers.get(SESSION_ID_HEADER)
    if key is None:
        key = body.get(SESSION_ID_FIELD)
        if key is not None and not isinstance(key, str):
            raise InvalidRequest(f"{SESSION_ID_FIELD} must be a string", param=SESSION_ID_FIELD)
    if key is None or key == "":
        return None
    if len(key) > MAX_ID_CHARS:
        raise InvalidRequest(f"the session id is longer than {MAX_ID_CHARS} characters", param=SESSION_ID_FIELD)
    return key
