"""What SGLang's replies mean: pure functions from its bytes to events and typed errors (no I/O).

One home for SGLang's reply shapes, read by every caller: the stream's SSE events (`parse_event`, which
sglang/events.py's decoder imports), a non-200 answer (`error_from_status`), a JSON body that is
not (`loads`, `invalid_json`), and SGLang's words for an adapter a worker does not hold
(`is_lost_adapter`, a retry rule's test), the weight versions a reply carries (`weight_versions`, the
stale-weights rule's), SGLang's words in any error body (`message_of`) and sglang-router's worker list
(`router_workers`).
"""

from __future__ import annotations

import re

import orjson

from token_proxy.errors import BackendError, BackendTimeout, BackendUnavailable, InvalidRequest, ProxyError

DONE_EVENT = object()  # what parse_event returns for SGLang's [DONE]

# SGLang's words on /generate for an adapter a (restarted) worker does not hold.
LOST_ADAPTER = ("has never been loaded", "are not loaded")


def parse_event(raw: bytes) -> tuple[dict | object | None, ProxyError | None]:
    """One raw SSE event -> (the event, or DONE_EVENT, or None: no data) or its error."""
    data = event_data(raw)
    if data is None:
        return None, None
    if data == b"[DONE]":
        return DONE_EVENT, None
    event = loads(data)
    return event, stream_error(event)


def event_data(event: bytes) -> bytes | None:
    if event.startswith(b"data: ") and b"\n" not in event:  # SGLang's one-line events
        return event[6:]
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def loads(body: bytes):
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid_json(body) from exc


def invalid_json(body: bytes) -> BackendError:
    return BackendError(f"SGLang sent invalid JSON: {body[:200]!r}")


_HTML = re.compile(r"\s*<(!doctype|html|head|body|title|h1)\b", re.IGNORECASE)
_TITLE = re.compile(r"<title>(.*?)</title>", re.IGNORECASE | re.DOTALL)


def html_page(text: str) -> str | None:
    """One line for a web server's HTML page (a backend that is not SGLang, or a proxy's error page), else None:
    a 13-line page in a log says less than its title."""
    if not _HTML.match(text):
        return None
    title = _TITLE.search(text)
    named = f" titled {' '.join(title.group(1).split())[:80]!r}" if title else ""
    return f"an HTML page{named}, not SGLang's JSON (is this URL SGLang's?)"


def error_from_status(status: int, body: bytes) -> ProxyError:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    text = body.decode("utf-8", "replace").strip()
    message = message_of(parsed) or (parsed is None and html_page(text)) or text or f"HTTP {status}"
    if status == 400:
        return InvalidRequest(f"SGLang rejected the request: {message}")
    if status in (502, 503):
        return BackendUnavailable(f"SGLang is unavailable ({status}): {message}")
    if status == 504:
        return BackendTimeout(f"SGLang timed out: {message}")
    return BackendError(f"SGLang failed with HTTP {status}: {message}")


def stream_error(event) -> ProxyError | None:
    """An error event, or SGLang's scheduler refusing the request (an abort carrying an HTTP status
    before any token, e.g. an input past max_req_input_len)."""
    if not isinstance(event, dict):
        return BackendError(f"SGLang sent an unexpected stream event: {str(event)[:200]}")
    if "error" in event:
        return error_from_body(event)
    finish = (event.get("meta_info") or {}).get("finish_reason")
    if not finish:  # every event but the last
        return None
    status = finish.get("status_code") if isinstance(finish, dict) else None
    if finish.get("type") == "abort" and isinstance(status, int) and status >= 400 and not event.get("output_ids"):
        return error_from_status(status, orjson.dumps({"message": finish.get("message")}))
    return None


def error_from_body(event: dict) -> ProxyError:
    message = message_of(event) or "unknown error"
    code = event["error"].get("code") if isinstance(event.get("error"), dict) else None
    if code == 400:
        return InvalidRequest(f"SGLang rejected the request: {message}")
    return BackendError(f"SGLang failed: {message}")


def message_of(parsed) -> str | None:
    """SGLang's own words in a JSON body: `error.message` (or `error`), `message`, `error_message`, `detail`."""
    if not isinstance(parsed, dict):
        return None
    error = parsed.get("error")
    text = ((error.get("message") if isinstance(error, dict) else error) or parsed.get("message")
            or parsed.get("error_message") or parsed.get("detail"))
    return str(text) if text else None


def router_workers(raw: bytes) -> dict[str, str] | None:
    """sglang-router's GET /workers: url -> id of each worker it lists (sglang-router 0.3 names each by a
    UUID; an older one by its url), or None when the body is no such list (a plain SGLang answers 404)."""
    try:
        workers = orjson.loads(raw).get("workers")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if not isinstance(workers, list):
        return None
    return {w["url"].rstrip("/"): str(w.get("id") or w["url"]) for w in workers
            if isinstance(w, dict) and isinstance(w.get("url"), str) and w["url"]}


def is_lost_adapter(message: str) -> bool:
    """SGLang refused a request because the worker does not hold the adapter (it restarted)."""
    return any(words in message for words in LOST_ADAPTER)


def weight_versions(items) -> set[str]:
    """The weight versions SGLang reports in each item's (or stream event's) meta_info."""
    out = set()
    for item in items:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        version = meta.get("weight_version") if isinstance(meta, dict) else None
        if version is not None:
            out.add(str(version))
    return out


def version_text(value) -> str | None:
    """A weight version as a body carries it (a string, or a number a client sent), as text; None: absent."""
    return None if value is None else str(value)
