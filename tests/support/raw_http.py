"""A raw HTTP/1.1 test server on 127.0.0.1, for what aiohttp's own server will not do on cue: close a connection
unanswered, break a body off, answer never. It reads each request one way (the head, then the Content-Length
body); a test's subclass scripts the answers in `answer`."""

from __future__ import annotations

import asyncio
import itertools


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request off the connection: its head (through the blank line) and its Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length")), 0)
    return head, await reader.readexactly(length)


class RawHTTPServer:
    """Connections are numbered from 0 in the order they open, and requests from 0 on each connection;
    `closed` lists the connections the server has closed, in order."""

    def __init__(self) -> None:
        self.connections = 0
        self.closed: list[int] = []

    async def answer(self, conn: int, n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answers request `n` of connection `conn`; False closes the connection."""
        raise NotImplementedError

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        try:
            for n in itertools.count():
                await read_request(reader)
                if not await self.answer(conn, n, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.append(conn)
            writer.close()

    async def start(self) -> tuple[asyncio.Server, str]:
        """Listens on a free port; returns the listener (`async with` it) and the server's URL."""
        listener = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return listener, f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
