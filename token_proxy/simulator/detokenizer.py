"""Incremental text for one output: complete characters only, stop strings found as they appear."""

from __future__ import annotations

import codecs
import re

from token_proxy.simulator.sampling_params import SamplingParams

# Stop regexes are matched against this much trailing text (SGLang matches a
# window of recent tokens, sized from the pattern).
REGEX_WINDOW = 256


class TextTracker:
    """Bytes in, text out; an unfinished UTF-8 character stays in the decoder.

    That is the same hold-back SGLang's detokenizer applies to a stream, so
    text sent mid-stream never ends in U+FFFD while a character is split.
    """

    def __init__(self, params: SamplingParams):
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._stops = tuple(s for s in params.stop if s)
        self._regexes = params.stop_regex
        self._max_stop = params.max_stop_len
        self._chunks: list[str] = []
        self._joined = ""  # "".join(self._chunks[:self._joined_count]), extended lazily
        self._joined_count = 0
        self._tail = ""  # the last few characters, all that stop matching needs
        self._flushed = False

    @property
    def text(self) -> str:
        if self._joined_count < len(self._chunks):
            self._joined += "".join(self._chunks[self._joined_count :])
            self._joined_count = len(self._chunks)
        return self._joined

    def feed(self, data: bytes) -> str | None:
        """Append bytes; return the stop string or regex now matched, if any."""
        new = self._decoder.decode(data) if data else ""
        if not new:
            return None
        self._chunks.append(new)
        if not (self._stops or self._regexes):
            return None
        window = self._tail[-(self._max_stop - 1) :] if self._max_stop > 1 else ""
        self._tail = (self._tail + new)[-max(self._max_stop, REGEX_WINDOW if self._regexes else 0) :]
        return self._stop_hit(window + new)

    def _stop_hit(self, window: str) -> str | None:
        for stop in self._stops:
            if stop in window:
                return stop
        return next((pattern for pattern in self._regexes if re.search(pattern, self._tail)), None)

    def ends_in_stop_prefix(self) -> bool:
        """SGLang holds a stream event back while the text could be the start of a stop string."""
        tail = self._tail[-self._max_stop :] if self._max_stop else ""
        return any(
            tail.endswith(stop[:i]) for stop in self._stops for i in range(1, min(len(tail), len(stop)) + 1)
        )

    def flush(self) -> str:
        """The final text: an unfinished character becomes U+FFFD, as a full decode would show it."""
        if not self._flushed:
            self._chunks.append(self._decoder.decode(b"", True))
            self._flushed = True
        return self.text


def trim_at_stop(text: str, matched, no_stop_trim: bool) -> str:
    """DetokenizerManager.trim_matched_stop for a matched string (first occurrence)."""
    if not isinstance(matched, str):
        return text
    pos = text.find(matched)
    if pos == -1:
        return text
    return text[: pos + len(matched)] if no_stop_trim else text[:pos]
