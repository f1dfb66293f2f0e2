"""SGLangBroadcaster: rank 0 of SGLang's weight-update group, talking to SGLang through the proxy.

SGLang receives a push like this: an HTTP call announces names, dtypes and shapes
(/update_weights_from_distributed) and stays open while the trainer broadcasts each tensor, in
that order, from rank 0; SGLang answers once it has loaded them. So every bucket is one HTTP call
in a background thread plus one broadcast per tensor here, and the call's answer is checked.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from token_proxy.broadcast.group import join_group, leave_group

POLL_S = 0.005
HTTP_MARGIN_S = 30.0  # the HTTP call may outlive the broadcast by SGLang's load time


class BroadcastError(RuntimeError):
    """The engine refused, a peer never joined, or a push did not finish in time."""


@dataclass
class SGLangBroadcaster:
    url: str  # the proxy (fans out to every worker) or one SGLang server
    master_address: str  # where this trainer process is reachable from the SGLang hosts
    master_port: int
    inference_world_size: int = 1  # SGLang ranks in the group, over all workers (sum of tp sizes)
    group_name: str = "weight_update_group"
    backend: str = "nccl"  # "gloo" for CPU tests
    timeout_s: float = 300.0  # bounds the group join and each bucket's broadcast
    bucket_bytes: int = 512 * 1024 * 1024
    device: str | None = None  # where tensors are sent from ("cuda" for NCCL); None: where they are
    _group: object = field(default=None, repr=False)
    _http: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="broadcaster"),
        repr=False)

    def init(self, announce: bool = True) -> None:
        """Join as rank 0. With `announce`, ask the engine to join too (/init_weights_update_group,
        SGLang ranks from 1); without it, someone else does (prime-rl's orchestrator: /init_broadcaster)."""
        world_size = self.inference_world_size + 1
        body = {"master_address": self.master_address, "master_port": self.master_port, "rank_offset": 1,
                "world_size": world_size, "group_name": self.group_name, "backend": self.backend}
        call = self._post_async("/init_weights_update_group", body, self.timeout_s) if announce else None
        join = self._http.submit(join_group, self.master_address, self.master_port, 0, world_size,
                                 self.group_name, self.backend, self.timeout_s)
        where = f"tcp://{self.master_address}:{self.master_port}"
        try:
            self._wait(join, call, "init_weights_update_group",
                       f"the inference engine did not join the weight-update group at {where} "
                       f"(world size {world_size}) within {self.timeout_s:g} s")
            self._group = join.result()
            if call is not None:
                self._check(call.result(), "init_weights_update_group")
        except BroadcastError:
            join.add_done_callback(_leave_if_joined)  # a group nobody uses must not keep its name
            self._group = None
            raise
        except Exception as exc:
            raise BroadcastError(f"joining the weight-update group at {where} failed: {exc}") from exc

    def update(self, named_tensors: Iterable, version: str | None = None) -> int:
        """Push (name, tensor) pairs in buckets of about `bucket_bytes`; the last bucket carries
        `version` (SGLang then reports it in every reply). Returns the number of buckets."""
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
            return
        try:
            if announce:
                reply = self._post_async("/destroy_weights_update_group", {"group_name": self.group_name},
                                         self.timeout_s).result()
                self._check(reply, "destroy_weights_update_group")
        finally:
            group, self._group = self._group, None
            leave_group(group)
            self._http.shutdown(wait=False, cancel_futures=True)

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
        import torch.distributed as dist

        body = {"names": [name for name, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self.group_name, "flush_cache": last, "weight_version": version}
        call = self._post_async("/update_weights_from_distributed", body, self.timeout_s + HTTP_MARGIN_S)
        handles = [dist.broadcast(t, src=0, group=self._group, async_op=True) for _, t in bucket]
        self._wait(_AllDone(handles), call, "update_weights_from_distributed",
                   f"the broadcast of {len(bucket)} tensor(s) did not complete within {self.timeout_s:g} s")
        for handle in handles:
            handle.wait()
        self._check(call.result(timeout=self.timeout_s + HTTP_MARGIN_S), "update_weights_from_distributed")

    def _wait(self, work, call, action: str, late: str) -> None:
        """Until `work` is done; the engine refusing first (e.g. the proxy's validation) ends it at once,
        since no peer will come to the collective."""
        deadline = time.monotonic() + self.timeout_s
        while not work.done():
            if call is not None and call.done():
                status, message = call.result()
                if status != 200:
                    raise BroadcastError(f"{action} refused ({status}): {message}")
            if time.monotonic() > deadline:
                raise BroadcastError(late)
            time.sleep(POLL_S)

    def _check(self, reply: tuple[int, str], action: str) -> None:
        status, message = reply
        if status != 200:
            raise BroadcastError(f"{action} failed ({status}): {message}")

    def _post_async(self, path: str, body: dict, timeout_s: float) -> concurrent.futures.Future:
        return self._http.submit(_post, f"{self.url.rstrip('/')}{path}", body, timeout_s)


def _leave_if_joined(join: concurrent.futures.Future) -> None:
    if not join.cancelled() and join.exception() is None:
        leave_group(join.result())


class _AllDone:
    def __init__(self, handles: list):
        self._handles = handles

    def done(self) -> bool:
        return all(handle.is_completed() for handle in self._handles)


def _post(url: str, body: dict, timeout_s: float) -> tuple[int, str]:
    """(status, SGLang's or the proxy's message); {"success": false} under 200 counts as 400."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return 0, f"{url} is unreachable: {exc}"
    message = _message(raw)
    if status == 200 and '"success":false' in raw.decode("utf-8", "replace").replace(" ", ""):
        return 400, message
    return status, message


def _message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace").strip()
    if isinstance(body, dict):
        error = body.get("error")
        text = body.get("message") or body.get("error_message") or (
            error.get("message") if isinstance(error, dict) else error)
        if text:
            return str(text)
    return json.dumps(body)
