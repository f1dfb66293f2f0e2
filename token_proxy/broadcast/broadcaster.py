"""SGLangBroadcaster: rank 0 of SGLang's weight-update group, talking to SGLang through the proxy.

SGLang receives a push like this: an HTTP call announces names, dtypes and shapes
(/update_weights_from_distributed) and stays open while the trainer broadcasts each tensor, in
that order, from rank 0; SGLang answers once it has loaded them. So every bucket is one HTTP call
and one collective (a broadcast per tensor), each in a thread of its own, and the two race: the first
failure (SGLang refusing, a peer gone, `timeout_s` passed) ends both. The call is cancelled and a
collective that may never finish has its communicator aborted (NCCL starts it inside the first
broadcast, blocking its caller until every rank connects: that is why it has a thread too).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from token_proxy.broadcast.errors import BroadcastError
from token_proxy.broadcast.group import abort_group, join_group, leave_group
from token_proxy.broadcast.http_call import FanOutCall, HTTPCall
from token_proxy.broadcast.nccl_env import match_sglang

__all__ = ["BroadcastError", "SGLangBroadcaster"]

POLL_S = 0.005
SETTLE_S = 0.5  # how long a collective may take to finish after SGLang's answer before it counts as stuck
ABORT_WAIT_S = 2.0  # an abort that has not returned by then is left to its thread
# The group's own collective timeout and the HTTP socket's come later than `timeout_s`, so this side decides
# and aborts first (and torch's NCCL watchdog, which tears the process down on a timeout by default, never
# fires); they only end what was left behind.
BACKSTOP_MARGIN_S = 30.0


@dataclass
class SGLangBroadcaster:
    url: str | Sequence[str]  # the proxy (fans out to every worker), one SGLang server, or several proxies
    # (one per inference node, each in front of inference_world_size / len(url) ranks: every call goes to all)
    master_address: str  # where this trainer process is reachable from the SGLang hosts
    master_port: int
    inference_world_size: int = 1  # SGLang ranks in the group, over all workers (sum of tp sizes)
    group_name: str = "weight_update_group"
    backend: str = "nccl"  # "gloo" for CPU tests
    timeout_s: float = 300.0  # bounds the group join and each bucket (its broadcast and SGLang's answer)
    bucket_bytes: int = 512 * 1024 * 1024
    device: str | None = None  # where tensors are sent from ("cuda" for NCCL); None: where they are

    def __post_init__(self) -> None:
        self._group = None
        self._announced = False  # init() asked the engine to join: a failed push asks it to leave
        self._cleanup: HTTPCall | FanOutCall | None = None  # that request, waited for by the next init()
        self._stuck: tuple[concurrent.futures.Future, int] | None = None  # an aborted push's collective, port

    def init(self, announce: bool = True) -> None:
        """Join as rank 0. With `announce`, ask the engine to join too (/init_weights_update_group,
        SGLang ranks from 1); without it, someone else does (prime-rl's orchestrator: /init_broadcaster).
        With NCCL, sets NCCL_CUMEM_ENABLE=0 first (SGLang's setting), or raises if that is too late."""
        if self.backend == "nccl":
            match_sglang()
        self._abort()  # a group from an earlier init
        self._settle()
        self._check_port()
        world_size = self.inference_world_size + 1
        body = {"master_address": self.master_address, "master_port": self.master_port, "rank_offset": 1,
                "world_size": world_size, "group_name": self.group_name, "backend": self.backend}
        call = self._call("/init_weights_update_group", body, self._rank_offsets()) if announce else None
        join = _spawn(join_group, self.master_address, self.master_port, 0, world_size, self.group_name,
                      self.backend, self.timeout_s, self.timeout_s + BACKSTOP_MARGIN_S)
        where = f"tcp://{self.master_address}:{self.master_port}"
        try:
            self._race(join, call, "init_weights_update_group",
                       late=f"the inference engine did not join the weight-update group at {where} "
                            f"(world size {world_size}) within {self.timeout_s:g} s",
                       broken=f"joining the weight-update group at {where} failed")
        except BroadcastError:
            if call is not None:
                call.cancel()
            join.add_done_callback(_abort_if_joined)  # a group nobody uses must not keep its name
            raise
        self._group, self._announced = join.result(), announce

    def update(self, named_tensors: Iterable, version: str | None = None) -> int:
        """Push (name, tensor) pairs in buckets of about `bucket_bytes`; the last bucket carries
        `version` (SGLang then reports it in every reply). Returns the number of buckets. A bucket that
        fails leaves no group behind where its collective did not finish: init() again."""
        if self._group is None:
            raise BroadcastError("init() first: there is no weight-update group")
        buckets = self._buckets(named_tensors)
        pending, sent = next(buckets, None), 0
        while pending is not None:
            following = next(buckets, None)
            self._send(pending, version if following is None else None, last=following is None)
            pending, sent = following, sent + 1
        return sent

    def close(self, announce: bool = True) -> None:
        if self._group is None:
            self._settle()
            return
        try:
            if announce:
                call = self._call("/destroy_weights_update_group", {"group_name": self.group_name})
                try:
                    reply = call.future.result(timeout=self.timeout_s)
                except concurrent.futures.TimeoutError:
                    call.cancel()
                    raise BroadcastError(f"destroy_weights_update_group got no answer within "
                                         f"{self.timeout_s:g} s") from None
                self._check(reply, "destroy_weights_update_group")
        finally:
            group, self._group = self._group, None
            leave_group(group)

    def _buckets(self, named_tensors: Iterable) -> Iterator[list]:
        bucket, size = [], 0
        for name, tensor in named_tensors:
            tensor = tensor.detach()
            tensor = (tensor.to(self.device) if self.device else tensor).contiguous()
            if bucket and size + tensor.nbytes > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += tensor.nbytes
        if bucket:
            yield bucket

    def _send(self, bucket: list, version: str | None, last: bool) -> None:
        body = {"names": [name for name, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self.group_name, "flush_cache": last, "weight_version": version}
        tensors = [tensor for _, tensor in bucket]
        call = self._call("/update_weights_from_distributed", body)
        stop = threading.Event()
        push = _spawn(_broadcast, self._group, tensors, _stream_context(tensors), stop)
        try:
            self._race(push, call, "update_weights_from_distributed",
                       late=f"the broadcast of {len(bucket)} tensor(s) did not complete within {self.timeout_s:g} s",
                       broken=f"the broadcast of {len(bucket)} tensor(s) failed")
        except BroadcastError:
            if call.future.done():  # SGLang answered: after receiving all (a load error) or none of it
                concurrent.futures.wait([push], SETTLE_S)
            call.cancel()
            stop.set()
            if not push.done() or push.exception() is not None:  # the communicator may hang: abort it
                self._abort()
                self._stuck = (push, self.master_port)
            raise

    def _race(self, work: concurrent.futures.Future, call: HTTPCall | FanOutCall | None, action: str, late: str,
              broken: str) -> None:
        """Until `work` is done and the engine answered 200, within `timeout_s`; the first failure raises:
        the engine refusing (e.g. the proxy's validation) ends it at once, since no peer will come."""
        deadline = time.monotonic() + self.timeout_s
        pending = {work} if call is None else {work, call.future}
        while pending:
            done, pending = concurrent.futures.wait(pending, max(0.0, deadline - time.monotonic()),
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
            if call is not None and call.future in done:
                self._check(call.future.result(), action)
            if work in done and work.exception() is not None:
                raise BroadcastError(f"{broken}: {work.exception()}")
            if not done:
                raise BroadcastError(late if work in pending else
                                     f"{action} got no answer within {self.timeout_s:g} s")

    def _abort(self) -> None:
        """Abort this side's communicator and free the group name; ask the engine to leave the group too
        where init() asked it to join (the next init() waits for that answer, at most `timeout_s`)."""
        group, self._group = self._group, None
        if group is None:
            return
        abort_group(group, ABORT_WAIT_S)
        if self._announced:
            self._cleanup = self._call("/destroy_weights_update_group", {"group_name": self.group_name})

    def _check_port(self) -> None:
        """A collective that an abort could not end (NCCL blocked in starting its communicator) keeps its
        group, and with it the rendezvous store on its port: torch's tcp:// rendezvous shares one store per
        port in a process, so a new group there would read the old group's keys."""
        stuck, self._stuck = self._stuck, None
        if stuck is None or stuck[1] != self.master_port:
            return
        concurrent.futures.wait([stuck[0]], ABORT_WAIT_S)
        if not stuck[0].done():
            self._stuck = stuck
            raise BroadcastError(f"the aborted push's broadcast is still blocked in NCCL and holds the rendezvous "
                                 f"at port {self.master_port}: init() with another master_port, or restart the "
                                 "trainer")

    def _settle(self) -> None:
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None:
            concurrent.futures.wait([cleanup.future], self.timeout_s)
            cleanup.cancel()

    def _check(self, reply: tuple[int, str], action: str) -> None:
        status, message = reply
        if status != 200:
            raise BroadcastError(f"{action} failed ({status}): {message}")

    @property
    def urls(self) -> list[str]:
        return [self.url] if isinstance(self.url, str) else list(self.url)

    def _rank_offsets(self) -> list[int]:
        """Each server's first rank: prime-rl's rule (utils/client.py init_nccl_broadcast), every server
        inference_world_size / servers ranks, after the trainer's rank 0."""
        per_server, extra = divmod(self.inference_world_size, len(self.urls))
        if extra:
            raise BroadcastError(f"inference_world_size {self.inference_world_size} is not a multiple of the "
                                 f"{len(self.urls)} servers: each server must hold as many ranks")
        return [1 + i * per_server for i in range(len(self.urls))]

    def _call(self, path: str, body: dict, rank_offsets: list[int] | None = None) -> HTTPCall | FanOutCall:
        timeout_s = self.timeout_s + BACKSTOP_MARGIN_S
        if isinstance(self.url, str):
            return HTTPCall(f"{self.url.rstrip('/')}{path}", body, timeout_s)
        offsets = rank_offsets or [None] * len(self.urls)
        return FanOutCall([(f"{url.rstrip('/')}{path}", body if offset is None else {**body, "rank_offset": offset})
                           for url, offset in zip(self.urls, offsets)], timeout_s)


def _spawn(function: Callable, *args) -> concurrent.futures.Future:
    """`function(*args)` in a daemon thread: one that never returns (an NCCL call stuck on a dead peer)
    must not keep the trainer from exiting."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except Exception as exc:  # noqa: BLE001 - handed to the waiting thread, which raises it
            # without its frames: they hold the group, whose rendezvous store would keep the port
            future.set_exception(exc.with_traceback(None))

    threading.Thread(target=run, name=f"broadcaster-{function.__name__.strip('_')}", daemon=True).start()
    return future


def _broadcast(group, tensors: list, stream_context: Callable, stop: threading.Event) -> None:
    """Rank 0's broadcast of each tensor, until all completed (or `stop`); raises the collective's error
    (gloo: a peer gone or timed out; NCCL: an aborted or failed communicator)."""
    import torch.distributed as dist

    with stream_context():
        handles = [dist.broadcast(tensor, src=0, group=group, async_op=True) for tensor in tensors]
        while not all(handle.is_completed() for handle in handles):
            if stop.wait(POLL_S):
                return
        for handle in handles:
            handle.wait()


def _stream_context(tensors: list) -> Callable:
    """The caller's CUDA stream (where the tensors were made), for the collective's thread: a new thread
    starts on each device's default stream, which may not have seen them yet."""
    cuda = next((tensor for tensor in tensors if tensor.is_cuda), None)
    if cuda is None:
        return contextlib.nullcontext
    import torch

    stream = torch.cuda.current_stream(cuda.device)
    return lambda: torch.cuda.stream(stream)


def _abort_if_joined(join: concurrent.futures.Future) -> None:
    if not join.cancelled() and join.exception() is None:
        abort_group(join.result(), ABORT_WAIT_S)
