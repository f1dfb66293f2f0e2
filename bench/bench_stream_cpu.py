"""CPU per streamed event in the proxy's own Python: a deterministic micro-benchmark (no server, no GPU).

Feeds SGLang incremental-stream bytes, as SGLang 0.5.17 writes them (chunked transfer encoding, one
event per chunk, one token per event, meta_info laid out as in /work/shared/golden/generate_stream.json),
through the real stream reader (RelayStream.data_received: HTTP/1.1 framing by sglang/http1.py, SSE split,
the event parse of sglang/replies.py),
the request's sink (stats, output rules, stream frames / chat formatter template) and the SSE writer,
into a transport. Every SGLang event is its own network read, as on the GPU host at c=256.

Transports: `noop` (write does nothing: the proxy's Python alone) and `socket` (write = a
non-blocking send on a socketpair, drained by the benchmark outside the timed region: Python + the
send syscall a real transport makes per write). CPU is time.process_time over many streams; each
variant runs `--rounds` interleaved rounds and the table shows the median and spread (min..max).

    python bench/bench_stream_cpu.py [--streams 300] [--rounds 7] [--tokens 128] [--framer h11]

`--framer h11` frames the bytes with h11 instead (tests/sglang/h11_framer.py, the test's reference; run from
the repository root): what made sglang/http1.py hand-written.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import time
from typing import ClassVar

import orjson

from token_proxy.api.chat.format import ChatFormatter
from token_proxy.api.chat.request import parse_chat_request
from token_proxy.api.logprobs import TokenNamer
from token_proxy.pipeline.call import _relay
from token_proxy.pipeline.output_rules import OutputRules
from token_proxy.pipeline.request_state import RequestStats
from token_proxy.pipeline.stream_frames import StreamFrames
from token_proxy.sglang.relay import RelayStream
from token_proxy.vocabulary import ResponseMeta

VOCAB = 151665
EOS = 151645
RID = "b0e6e0bd9be34d34be864cdefc110800"


def sglang_event(i: int, tokens: int) -> bytes:
    """SGLang 0.5.17's incremental event i (of `tokens`), key order as recorded."""
    last = i == tokens - 1
    meta = {"id": RID, "finish_reason": {"type": "length", "length": tokens} if last else None,
            "prompt_tokens": 838, "weight_version": "default", "num_retractions": 0,
            "forward_entry_time": 1795239990.76362, "prefill_finished_time": 1795239990.7692046,
            "queue_time": 0.00029850006103515625, "reasoning_tokens": 0, "completion_tokens": i + 1,
            "cached_tokens": 14, "cached_tokens_details": {"device": 14, "host": 0}, "dp_rank": None,
            "response_sent_to_client_ts": 1795239990.7714548 + i * 0.01}
    if last:
        meta.update(e2e_latency=1.2, request_received_ts=1795239990.7, api_server_dispatch_finish_ts=1795239990.71,
                    request_finished_ts=1795239992.0)
    return b"data: " + orjson.dumps({"text": f" w{i % 50}", "output_ids": [1000 + i % 5000], "meta_info": meta}) + b"\n\n"


def chunked_reads(tokens: int, per_read: int = 1) -> list[bytes]:
    """The network reads of one stream: headers + first event, then `per_read` chunks per read, then the end."""
    chunks = [b"%x\r\n%b\r\n" % (len(ev), ev) for ev in (sglang_event(i, tokens) for i in range(tokens))]
    done = b"data: [DONE]\n\n"
    head = (b"HTTP/1.1 200 OK\r\ndate: x\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    rest = [b"".join(chunks[i:i + per_read]) for i in range(per_read, tokens, per_read)]
    return [head + b"".join(chunks[:per_read]), *rest, b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done)]


class Transport:
    """The client's transport: `write` either does nothing or sends on a socketpair."""

    def __init__(self, sock: socket.socket | None):
        self._sock = sock
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self.bytes += len(data)
        if self._sock is not None:
            self._sock.send(data)

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    # the upstream side (RelayStream's transport)
    def close(self):
        pass

    def abort(self):
        pass

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


class Request:
    def __init__(self, transport):
        self.transport = transport


class Response:
    headers: ClassVar[dict] = {"Transfer-Encoding": "chunked"}

    async def write(self, data):
        self.written = data


def make_stream_parts():
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "max_tokens": 128, "ignore_eos": True}, VOCAB)
    meta = ResponseMeta("chatcmpl-" + "a" * 32, 1700000000, "Qwen/Qwen2.5-0.5B-Instruct", [[1, 2, 3]])

    class Texts:
        def text(self, token_id):
            return f"<{token_id}>"

    rules = OutputRules(req.sampling, 1, 838, EOS, lambda ids: "", True)
    return rules, ChatFormatter(req, meta, TokenNamer(Texts(), False))


async def one_stream(loop, reads: list[bytes], transport: Transport, drain) -> None:
    stream = RelayStream(loop, "http://x")
    stream.connection_made(Transport(None))
    rules, formatter = make_stream_parts()
    stream.data_received(reads[0])
    first = await stream.first()
    frames = StreamFrames(rules, formatter)
    request, response = Request(transport), Response()
    transport.write(frames.start(first))
    stats = RequestStats(endpoint="/v1/chat/completions")

    async def feed():
        for data in reads[1:]:
            stream.data_received(data)
            drain()
            await asyncio.sleep(0)

    feeder = asyncio.ensure_future(feed())
    await _relay(request, response, None, stream, [RID], rules, frames, stats)
    await feeder


async def measure(kind: str, streams: int, reads: list[bytes]) -> float:
    """CPU seconds for `streams` streams (the benchmark's own loop turns included in both kinds)."""
    loop = asyncio.get_running_loop()
    if kind == "socket":
        a, b = socket.socketpair()
        a.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        transport = Transport(a)

        def drain():
            try:
                while b.recv(1 << 20, socket.MSG_DONTWAIT):
                    pass
            except BlockingIOError:
                pass
    else:
        transport = Transport(None)
        a = b = None

        def drain():
            try:
                raise BlockingIOError  # the same Python work as the socket kind's drain, no syscall
            except BlockingIOError:
                pass
    t0 = time.process_time()
    for _ in range(streams):
        await one_stream(loop, reads, transport, drain)
    cpu = time.process_time() - t0
    if a is not None:
        a.close()
        b.close()
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--per-read", type=int, default=1, help="SGLang events per network read (1: a GPU's pace)")
    parser.add_argument("--framer", choices=("own", "h11"), default="own", help="HTTP/1.1 framing: sglang/http1.py or h11")
    args = parser.parse_args()
    if args.framer == "h11":
        from tests.sglang.h11_framer import H11Framer
        from token_proxy.sglang import relay

        relay.ResponseFramer = H11Framer
    reads = chunked_reads(args.tokens, args.per_read)
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    results: dict[str, list[float]] = {"noop": [], "socket": [], "feed only": []}

    async def feed_only(streams):  # the benchmark's own driving cost (reads, loop turns), no proxy work
        t0 = time.process_time()
        for _ in range(streams):
            for _data in reads[1:]:  # one turn per read, as `measure` drives them
                try:
                    raise BlockingIOError
                except BlockingIOError:
                    pass
                await asyncio.sleep(0)
        return time.process_time() - t0

    async def rounds():
        await measure("noop", 20, reads)  # warm-up
        for _ in range(args.rounds):
            results["feed only"].append(await feed_only(args.streams))
            results["noop"].append(await measure("noop", args.streams, reads))
            results["socket"].append(await measure("socket", args.streams, reads))

    runner(rounds())
    base = statistics.median(results["feed only"])
    events = args.tokens
    print(f"{args.streams} streams x {events} events, {args.per_read} per read, {args.framer} framer, "
          f"{args.rounds} rounds (median, min..max); "
          f"'net' subtracts the benchmark's own driving cost ({base / args.streams / events * 1e6:.1f} us/event)")
    print(f"| transport | us per event (net) | ms per {events}-token stream (net) | spread, ms per stream |")
    print("|---|---|---|---|")
    for kind in ("noop", "socket"):
        per_stream = [(c - base) / args.streams for c in results[kind]]
        med = statistics.median(per_stream)
        print(f"| {kind} | {med / events * 1e6:.1f} | {med * 1e3:.3f} | "
              f"{min(per_stream) * 1e3:.3f}..{max(per_stream) * 1e3:.3f} |")


if __name__ == "__main__":
    main()
