"""Helpers for code that tests against the simulator (SSE parsing, a client-side view of replies)."""

from __future__ import annotations

import orjson


def parse_sse(raw: bytes) -> list:
    """An SGLang SSE body -> [event dict, ..., "[DONE]"]; raises ValueError on bad framing."""
    if not raw.endswith(b"\n\n"):
        raise ValueError(f"SSE body does not end with a blank line: {raw[-50:]!r}")
    events = []
    for frame in raw.split(b"\n\n")[:-1]:
        if not frame.startswith(b"data: "):
            raise ValueError(f"not an SSE data frame: {frame[:50]!r}")
        payload = frame[len(b"data: ") :]
        events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


def stream_events(raw: bytes) -> list:
    """The events of an SSE body that must end with `data: [DONE]` (ValueError otherwise)."""
    events = parse_sse(raw)
    if not events or events[-1] != "[DONE]":
        raise ValueError("SSE body does not end with data: [DONE]")
    return events[:-1]
