"""SGLang's streamed /generate body -> events: the SSE decoder of the stream reader (sglang/relay.py).

A network read holds any number of events and may end mid-event: `EventDecoder` keeps the tail for the
next read. Every event is `data: <json>`; `data: [DONE]` ends the stream; an event carrying an error (or
SGLang's scheduler refusing the request) ends it with that error after the events before it. What one
event means (its JSON, SGLang's error shapes) is sglang/replies.py's `parse_event`.
"""

from __future__ import annotations

from token_proxy.sglang.replies import DONE_EVENT, parse_event

__all__ = ["DONE_EVENT", "EventDecoder"]


class EventDecoder:
    """One stream's SSE bytes -> its events (per read: the events complete so far, and what ends the stream)."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = b""  # SSE bytes after the last complete event

    def feed(self, data: bytes) -> tuple[list[dict], object]:
        """One network read -> (the events it completes, the pending tail first; the end: None, DONE_EVENT
        or the stream's error). An incomplete last event waits for the next read. The events go out before
        the end is acted on (an error after events still delivers them). Runs once per read of every
        stream (the relay's hot path), so the loop is here, not in a helper."""
        if self.pending:
            data = self.pending + data
        *raw_events, self.pending = data.split(b"\n\n")
        events = []
        if not raw_events:
            return events, None
        for raw in raw_events:
            event, error = parse_event(raw)
            if error is not None:
                return events, error
            if event is None:
                continue
            if event is DONE_EVENT:
                return events, DONE_EVENT
            events.append(event)
        return events, None

    def close(self) -> tuple[list[dict], object]:
        """At the end of the body: an unterminated last event, as `feed` gives it (a blank tail: nothing)."""
        return self.feed(b"\n\n")
