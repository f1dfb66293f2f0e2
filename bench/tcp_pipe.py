"""The floor for a stream relay: a raw TCP pipe on uvloop (no HTTP parsing, no Python per event beyond
`data_received` -> `write`). Each client connection gets its own connection to the backend; bytes go
both ways unchanged. bench/bench_app_cpu.py measures its CPU per stream next to the proxy's: what is
left of the proxy's per-event CPU after this floor is the proxy's own work.

    python bench/tcp_pipe.py --port 8100 --backend-port 30000
"""

from __future__ import annotations

import argparse
import asyncio


class Half(asyncio.Protocol):
    def __init__(self):
        self.peer: Half | None = None
        self.transport = None
        self.early: list[bytes] = []

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)
        else:
            self.early.append(data)

    def connection_lost(self, exc):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend-port", type=int, required=True)
    args = parser.parse_args()
    import uvloop

    async def serve():
        loop = asyncio.get_running_loop()

        class Front(Half):
            def connection_made(self, transport):
                super().connection_made(transport)
                self.connecting = loop.create_task(self.connect())  # held: the loop keeps only a weak ref

            async def connect(self):
                back = Half()
                back.peer, self.peer = self, back
                await loop.create_connection(lambda: back, "127.0.0.1", args.backend_port)
                for data in self.early:
                    back.transport.write(data)
                self.early.clear()

        server = await loop.create_server(Front, "127.0.0.1", args.port)
        await server.serve_forever()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
