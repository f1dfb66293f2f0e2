"""h11's reading of an HTTP/1.1 response behind ResponseFramer's interface: the reference the hand-written
framer (sglang/http1.py) is proved against (tests/sglang/test_http1.py), and the variant the CPU
benchmark measured (bench/bench_stream_cpu.py --framer h11)."""

from __future__ import annotations

import h11

from token_proxy.sglang.http1 import FramingError


class H11Framer:
    __slots__ = ("_conn", "done", "status")

    def __init__(self) -> None:
        self._conn = h11.Connection(h11.CLIENT)
        self._conn.send(h11.Request(method="POST", target="/generate",
                                    headers=[("Host", "sglang"), ("Content-Length", "0")]))
        self._conn.send(h11.EndOfMessage())
        self.status: int | None = None
        self.done = False

    def feed(self, data: bytes) -> bytes:
        if self.done:
            return b""
        self._conn.receive_data(data)
        return self._events()

    def ends_at_close(self) -> bool:
        if self.status is None or self.done:
            return False
        self._conn.receive_data(b"")
        try:
            self._events()
        except FramingError:
            return False
        return self.done

    def _events(self) -> bytes:
        out = []
        try:
            while not self.done:
                event = self._conn.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    break
                if isinstance(event, h11.Response):
                    self.status = event.status_code
                elif isinstance(event, h11.Data):
                    out.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    self.done = True
        except h11.RemoteProtocolError as exc:
            raise FramingError(str(exc)) from None
        return b"".join(out)
