"""sglang/http1.py's sans-IO framer, byte by byte, proved against h11 on the same bytes: the same status,
the same body, the same end, however the reads split them (and both refuse the same broken framing)."""

from __future__ import annotations

import pytest

from token_proxy.sglang.http1 import FramingError, ResponseFramer

from .h11_framer import H11Framer

BODY = b'data: {"text": "a"}\n\n' * 3 + b"data: [DONE]\n\n"


def chunked(body: bytes, size: int, ext: bytes = b"") -> bytes:
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x%b\r\n%b\r\n" % (len(p), ext, p) for p in parts) + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
RESPONSES = {
    "chunked": HEAD + chunked(BODY, 21),
    "chunked, one byte a chunk": HEAD + chunked(BODY, 1),
    "chunked with extensions and trailers": HEAD + chunked(BODY, 9, b";x=1")[:-2] + b"x-trailer: 1\r\n\r\n",
    "after 100 Continue": b"HTTP/1.1 100 Continue\r\n\r\n" + HEAD + chunked(BODY, 50),
    "content-length": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(BODY), BODY),
    "an error with a body": b"HTTP/1.1 400 Bad Request\r\ncontent-length: 13\r\n\r\n{\"error\": 1}\n",
    "chunked error": b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b"busy", 2),
}


def framed(framer, raw: bytes, piece: int) -> tuple[int | None, bytes, bool]:
    body = b"".join(framer.feed(raw[i:i + piece]) for i in range(0, len(raw), piece))
    return framer.status, body, framer.done


@pytest.mark.parametrize("name", RESPONSES)
def test_the_framer_reads_what_h11_reads_however_the_bytes_are_split(name):
    raw = RESPONSES[name]
    for piece in range(1, len(raw) + 1):
        ours = framed(ResponseFramer(), raw, piece)
        assert ours == framed(H11Framer(), raw, piece), piece
        assert ours[2] is True


def test_the_known_answers():
    assert framed(ResponseFramer(), RESPONSES["chunked"], 7) == (200, BODY, True)
    assert framed(ResponseFramer(), RESPONSES["chunked error"], 3) == (503, b"busy", True)
    assert framed(ResponseFramer(), RESPONSES["content-length"] + b"extra", 5) == (200, BODY, True)


def test_a_body_delimited_by_the_close_ends_there_and_a_cut_chunk_does_not():
    for make in (ResponseFramer, H11Framer):
        whole = make()
        assert whole.feed(b"HTTP/1.1 200 OK\r\n\r\n" + BODY) == BODY
        assert (whole.done, whole.ends_at_close()) == (False, True)
        cut = make()
        cut.feed(HEAD + chunked(BODY, 21)[:30])
        assert cut.ends_at_close() is False


@pytest.mark.parametrize(("raw", "message"), [
    (HEAD + b"zz\r\n", "bad chunk size b'zz'"),
    (HEAD + b"-5\r\n", "bad chunk size b'-5'"),
    (b"HTTP/1.1 OK\r\n\r\n", "bad status line 'HTTP/1.1 OK'"),
])
def test_broken_framing_is_refused_by_both(raw, message):
    with pytest.raises(FramingError, match=f"^{message}$"):
        ResponseFramer().feed(raw)
    with pytest.raises(FramingError):
        H11Framer().feed(raw)


@pytest.mark.parametrize(("head", "close"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", False),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n", True),
    (b"HTTP/1.1 200 OK\r\nconnection: Keep-Alive, Close\r\nContent-Length: 2\r\n\r\n", True),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n", True),
    (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n", False),
])
def test_close_says_whether_the_connection_can_carry_another_request(head, close):
    """The kept-alive pool (sglang/pool.py) reuses a connection only when the answer did not announce its close."""
    framer = ResponseFramer()
    assert (framer.feed(head + b"ok"), framer.done, framer.close) == (b"ok", True, close)
