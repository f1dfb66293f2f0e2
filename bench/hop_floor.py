"""Floors for one non-streamed chat hop (bench/bench_hop.py starts them): an aiohttp server on uvloop that
answers POST /v1/chat/completions with a fixed body after, per `--mode`,
- `answer`: nothing else (the aiohttp server's own cost);
- `aiohttp`: a pre-tokenized /generate to SGLang through an aiohttp ClientSession pool (the proxy's client);
- `raw`: the same /generate written on one kept-alive asyncio connection, its answer cut by Content-Length
  (a prototype of a minimal client: no pool rules, no retry, no timeouts; for measuring only).

    python bench/hop_floor.py --port 8100 --backend-port 30000 --mode aiohttp --body-file generate.json
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
import orjson
from aiohttp import web

REPLY = orjson.dumps({"id": "chatcmpl-x", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}]})


class RawConnection(asyncio.Protocol):
    """One request at a time (c=1): the answer's body, once Content-Length bytes are in."""

    def __init__(self) -> None:
        self.transport = None
        self.answer: asyncio.Future | None = None
        self.buffer = bytearray()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).lower()
        start = head.index(b"content-length:") + 15
        length = int(head[start:head.find(b"\r\n", start) if b"\r\n" in head[start:] else None])
        if len(self.buffer) >= end + 4 + length:
            body = bytes(self.buffer[end + 4:end + 4 + length])
            del self.buffer[:end + 4 + length]
            self.answer.set_result(body)


def create_floor(mode: str, backend_port: int, generate_body: bytes) -> web.Application:
    app = web.Application()
    url = f"http://127.0.0.1:{backend_port}/generate"
    head = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    state: dict = {}

    async def clients(app):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            state["session"] = session
            _, state["raw"] = await asyncio.get_running_loop().create_connection(
                RawConnection, "127.0.0.1", backend_port)
            yield
            state["raw"].transport.close()

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        if mode == "aiohttp":
            async with state["session"].post(url, data=generate_body, headers={"Content-Type": "application/json"},
                                             timeout=aiohttp.ClientTimeout(total=600, sock_connect=10)) as resp:
                orjson.loads(await resp.read())
        elif mode == "raw":
            raw = state["raw"]
            raw.answer = asyncio.get_running_loop().create_future()
            raw.transport.write(head % len(generate_body) + generate_body)
            orjson.loads(await raw.answer)
        return web.Response(body=REPLY, content_type="application/json")

    app.cleanup_ctx.append(clients)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", lambda request: web.Response())
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend-port", type=int, required=True)
    parser.add_argument("--mode", choices=["answer", "aiohttp", "raw"], required=True)
    parser.add_argument("--body-file", required=True, help="the /generate body to send (JSON)")
    args = parser.parse_args()
    with open(args.body_file, "rb") as f:
        body = f.read()
    import uvloop

    web.run_app(create_floor(args.mode, args.backend_port, body), host="127.0.0.1", port=args.port,
                access_log=None, print=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
