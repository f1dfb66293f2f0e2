"""A stream's SGLang events -> the SSE bytes sent to the client (step 10b of the pipeline, streamed).

The general way: the output rules turn each event into an `Output`, the endpoint's formatter into a
chunk, orjson into a frame. Most events of most streams are simpler: a plain stream (one choice,
SGLang's deltas, no stop strings or proxy stop ids: `OutputRules.plain`) whose formatter's running
chunks hold nothing but the new text and ids (no logprobs, no parsed deltas: `plain_chunks`). Those
events become bytes by a template cut from the formatter's own chunk: prefix + JSON of the text +
middle + JSON of the ids + suffix, byte for byte what the general way writes. The first and last
events of a choice, and any event of any other stream, take the general way.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

from token_proxy.http_io import DONE, sse_frames
from token_proxy.pipeline.output_rules import NOT_RUNNING, OutputRules
from token_proxy.vocabulary import Output

Template = Callable[[tuple], bytes]  # feed_running's (new text, new ids, ...) -> one SSE frame
TEXT_PROBE = "\u2063text-probe\u2063"
IDS_PROBE = [-271828182]


class StreamFrames:
    """One stream: `start(first events)`, `frames(events)` per network read, `finish()` at its end."""

    def __init__(self, rules: OutputRules, formatter):
        self._rules = rules
        self._formatter = formatter
        self._plain = rules.plain and formatter.plain_chunks  # the one rule for the template
        self._template: Template | None = None

    def start(self, events: list[dict]) -> bytes:
        return sse_frames(self._formatter.start()) + self.frames(events)

    def frames(self, events: list[dict]) -> bytes:
        template = self._template
        if template is None:
            if not self._plain:
                return sse_frames(self._chunks(events))
            # Cut once the stream's first chunk is out (see `plain_chunks`), and use it for the rest of
            # the same read: a read can hold many events (a fast engine, a busy loop).
            for k, event in enumerate(events):
                chunks = self._chunks((event,))
                if chunks:
                    self._template = chunk_template(self._formatter)
                    self._plain = self._template is not None
                    head = sse_frames(chunks)
                    return head + self.frames(events[k + 1:]) if k + 1 < len(events) else head
            return b""
        feed_running = self._rules.feed_running
        if len(events) == 1:  # one token per network read: most reads of most streams
            new = feed_running(events[0])
            if new is NOT_RUNNING:
                return sse_frames(self._chunks(events))
            return b"" if new is None else template(new)
        out = []
        for event in events:
            new = feed_running(event)
            if new is NOT_RUNNING:
                out.append(sse_frames(self._chunks((event,))))
            elif new is not None:
                out.append(template(new))
        return out[0] if len(out) == 1 else b"".join(out)

    def finish(self) -> bytes:
        return sse_frames(self._formatter.finish(self._rules.usage())) + DONE

    def _chunks(self, events) -> list[dict]:
        chunks = []
        for event in events:
            out = self._rules.feed(event)
            chunk = None if out is None else self._formatter.chunk(out)
            if chunk is not None:  # None: a delta a tool/reasoning parser held back entirely
                chunks.append(chunk)
        return chunks


def chunk_template(formatter) -> Template | None:
    """The formatter's chunk for a running choice's (text, ids), as bytes around two slots (either may
    be absent: no text in /generate's chunks, no ids without return_token_ids). None when a probe shows
    up more than once (a model name or request id that contains it): no template, the general way."""
    probe = Output(0, TEXT_PROBE, IDS_PROBE, [], [], None, None, False, {}, 1)
    frame = sse_frames([formatter.chunk(probe)])
    text, ids = orjson.dumps(TEXT_PROBE), orjson.dumps(IDS_PROBE)
    if frame.count(text) > 1 or frame.count(ids) > 1:
        return None
    if text in frame and ids in frame:
        head, rest = frame.split(text)
        if ids not in rest:  # ids before text: no formatter writes that
            return None
        middle, tail = rest.split(ids)
        return lambda new: b"".join((head, orjson.dumps(new[0]), middle, orjson.dumps(new[1]), tail))
    if text in frame:
        head, tail = frame.split(text)
        return lambda new: b"".join((head, orjson.dumps(new[0]), tail))
    if ids in frame:
        head, tail = frame.split(ids)
        return lambda new: b"".join((head, orjson.dumps(new[1]), tail))
    return lambda new: frame
