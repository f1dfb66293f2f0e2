"""HTTP/1.1 response framing, sans-IO: bytes in, body bytes out (no sockets, no loop, no callbacks).

The stream reader (sglang/relay.py) feeds it each network read of SGLang's answer to a streamed POST;
it finds the status line and headers, then the body: chunked (SGLang's streams: one event per chunk),
Content-Length, or delimited by the connection's close. 1xx answers are skipped; chunk extensions and
trailers are ignored. tests/sglang/test_http1.py proves it against h11 on the same bytes split at every
byte. It is hand-written rather than h11 because h11 about doubles the stream's CPU per token
(`bench/bench_stream_cpu.py --framer h11`: ~10 -> ~21 us per event).
"""

from __future__ import annotations

__all__ = ["FramingError", "ResponseFramer"]


class FramingError(ValueError):
    """SGLang's bytes are not HTTP/1.1 (the message names what was wrong)."""


class ResponseFramer:
    """One response: `feed(read)` -> the body bytes it completes. `status` is None until the head is in;
    `done` once the body has ended (the last chunk, or Content-Length bytes); at the connection's close,
    `ends_at_close()` says whether that was the body's end. `close`: the server will close the connection
    after this response (`Connection: close`, or HTTP/1.0 without keep-alive): it cannot carry another."""

    __slots__ = ("_buf", "_chunked", "_left", "_length", "_skip", "close", "done", "status")

    def __init__(self) -> None:
        self.status: int | None = None
        self.done = False
        self.close = False
        self._buf = b""  # bytes not yet framed (the head, or a chunk's size line)
        self._chunked = False
        self._length: int | None = None  # body bytes left (Content-Length; None: until the close)
        self._left = 0  # bytes left of the current chunk's payload
        self._skip = 0  # bytes left of the CRLF after it

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        self._buf = b""
        if self.status is None:
            buf = self._head(buf)
            if buf is None:
                return b""
        if self.done:
            return b""
        if self._chunked:
            return self._chunks(buf)
        return self._sized(buf)

    def ends_at_close(self) -> bool:
        """The connection closed: was the body delimited by it (no length, not chunked)?"""
        return self.status is not None and not self._chunked and self._length is None

    def _head(self, buf: bytes) -> bytes | None:
        """The bytes after the (final, non-1xx) head; None: the head is not complete yet."""
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._buf = buf
                return None
            lines, buf = buf[:end].decode("latin-1").split("\r\n"), buf[end + 4:]
            status = _status_of(lines[0])
            if not 100 <= status < 200:
                self.close = lines[0].startswith("HTTP/1.0")
                self._headers(lines[1:])
                self.status = status
                return buf

    def _headers(self, lines: list[str]) -> None:
        for line in lines:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "transfer-encoding" and "chunked" in value.lower():
                self._chunked = True
            elif name == "content-length":
                self._length = int(value.strip())
            elif name == "connection":
                value = value.strip().lower()
                self.close = "close" in value or (self.close and "keep-alive" not in value)
        if self._chunked:
            self._length = None

    def _sized(self, buf: bytes) -> bytes:
        if self._length is not None:
            buf = buf[: self._length]
            self._length -= len(buf)
            self.done = self._length == 0
        return buf

    def _chunks(self, buf: bytes) -> bytes:
        """Chunked body bytes -> their payloads. Runs once per network read of every stream: the common
        case (whole chunks) stays in this loop; a chunk split across reads goes through `_partial`."""
        out = []
        pos, size = 0, len(buf)
        while pos < size:
            if self._skip or self._left:
                pos = self._partial(buf, pos, out)
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            length = _chunk_size(buf[pos:eol])
            pos = eol + 2
            if length == 0:  # the last chunk (trailers, if any, are not read)
                self.done = True
                break
            end = pos + length
            if end + 2 <= size:  # the whole chunk and its CRLF (SGLang writes an event per chunk)
                out.append(buf[pos:end])
                pos = end + 2
                continue
            self._left = length
        if pos < size and not self.done:
            self._buf = buf[pos:]
        return out[0] if len(out) == 1 else b"".join(out)

    def _partial(self, buf: bytes, pos: int, out: list[bytes]) -> int:
        """The rest of a chunk begun in an earlier read (its payload, then its CRLF): the new position."""
        n = min(self._skip or self._left, len(buf) - pos)
        if self._skip:
            self._skip -= n
            return pos + n
        out.append(buf[pos:pos + n])
        self._left -= n
        if not self._left:
            self._skip = 2
        return pos + n


def _status_of(line: str) -> int:
    try:
        return int(line.split(" ", 2)[1])
    except (IndexError, ValueError):
        raise FramingError(f"bad status line {line[:80]!r}") from None


def _chunk_size(line: bytes) -> int:
    try:
        size = int(line, 16)
    except ValueError:
        try:  # a chunk extension
            size = int(line.split(b";", 1)[0], 16)
        except ValueError:
            size = -1
    if size < 0:
        raise FramingError(f"bad chunk size {line[:40]!r}")
    return size
