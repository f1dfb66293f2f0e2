"""SGLang's streamed /generate body -> events: the one SSE decoder both stream readers use (the callback
relay, sglang/relay.py, and aiohttp's path, sglang/client.py).

A network read holds any number of events and may end mid-event: `EventDecoder` keeps the tail for the
next read. Every event is `data: <json>`; `data: [DONE]` ends the stream; an event carrying an error (or
SGLang's scheduler refusing the request) ends it with that error after the events before it. What one
event means (its JSON, SGLang's error shapes) is sglang/client.py's `_parse_event`, passed in: the same
JSON and error rules serve its non-streamed replies, which never run this module.
"""

from __future__ import annotations

from collections.abc import Callable

DONE_EVENT = object()  # what the event parser returns for SGLang's [DONE]
Parse = Callable[[bytes], tuple[object, BaseException | None]]  # raw event -> (event | DONE_EVENT | None, error)


class EventDecoder:
    """One stream's SSE bytes -> its events (per read: the events complete so far, and what ends the stream)."""

    __slots__ = ("_parse", "pending")

    def __init__(self, parse: Parse) -> None:
        self._parse = parse
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
        parse = self._parse
        for raw in raw_events:
            event, error = parse(raw)
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
