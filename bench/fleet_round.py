"""The GPU fleet round (issue 28): a trainer pushing weights into two SGLang workers behind sglang-router,
the proxy in front, all under continuous streamed and non-streamed rollouts, with every rollout's fate written
down.

    python bench/fleet_round.py --proxy http://127.0.0.1:8000 --worker http://127.0.0.1:30001 \
        --worker http://127.0.0.1:30002 --weights /tmp/tiny-qwen2 --backend nccl --device cuda \
        --kill-b 'kill -9 -- -$(cat /tmp/fleet/B.pid)' --restart-b 'bash /tmp/fleet/start_B.sh' \
        --md-out fleet.md --json-out fleet.json

Phases (each under the same rollout load; the load never stops between phases):
  steady        nothing else
  nccl-primerl  prime-rl's NCCL step: POST /init_broadcaster while the trainer joins (announce=False), /pause,
                /update_weights {"weight_dir": null} while the trainer pushes, /resume
  nccl-vllm     vLLM's drop-in (token_proxy.broadcast.vllm_engine): trainer_init, /pause?mode=keep, send_weights,
                /finish_weight_update {"weight_version"}, /resume (SkyRL's order)
  failed-push   prime-rl's step with a wrong shape in the middle (refused), then a retry with the same group name
  join-wedge    a join the trainer does not meet in time (the first GPU round's port race, made on purpose):
                /init_broadcaster {"timeout": 5} to a port nobody listens on: 504 after 5 s, /weight_info
                `joining` names both workers, chats sent past its 2 s grace a prompt 503 (refused, not lost;
                the load is held during the grace, whose chats would wait for the join's end); then the trainer
                joins on that port late: SGLang answers, the proxy destroys the late group, chats are served
                again; then a prime-rl step under the same group name lands
  disk          /pause, /update_weights {"weight_dir", "verify": "checksum"} (a checkpoint the trainer writes), /resume
  kill-b        worker B killed with -9, restarted, and the rollouts go on
  nccl-after    one more NCCL step (prime-rl's), the restarted worker included
  proxy-restart (issue 37) an NCCL step; the proxy (the controller) killed with -9 and started again; its
                start-up must not relabel (its /weight_info version is what the workers hold, its fence
                counters stay 0); rollouts go on through it; a second NCCL step through it
  replica       a follower (--fleet-controller) in front of the same router; half the clients go through it;
                one NCCL step through the controller, one with every admin call sent to the follower (it
                forwards them: the controller's record moves); both report the new version; the follower's
                fence counters stay 0
  findings-2-3  issue 37's findings 2 and 3: worker A on a version pushed over NCCL through another proxy (in
                front of A alone), B reset to 'default' behind the proxies' back, a new controller started
                over both: it never relabels (A keeps its version and weights, B is held, not healed); then
                both workers reset to 'default' directly on SGLang, and a disk transaction (verify checksum)
                under the load: no worker left paused, /weight_info consistent
Phases that restart or replace the proxy (proxy-restart, findings-2-3) stop sending and let the rollouts in
flight finish first (a rollout cut by a kill -9 is the client's retry, not the proxy's doing); their rows say
so in their steps. They need --router and --proxy-script (tests/e2e/fleet_proxy.sh).

Each rollout ends as:
  ok     a 200 with every token asked for (ignore_eos), on a weight version the fleet held while it ran
  stale  the same, but its (last) weight version is not one the fleet held while it ran
  mislabelled  ok or stale, but its version label was seen, during its phase, on a worker whose weights are not
         that version's (the weights checksum SGLang's /weights_checker gives, against the checksum the driver
         recorded when that version landed): an upper bound, as the driver does not know which worker served it
  refused  a prompt 503 with Retry-After sent while the driver itself had left no healthy worker (failed-push:
         the fleet held paused after the failed push, until the retry lands; findings-2-3: both workers reset
         behind the proxy's back, until the transaction brings them back): what issue 37 asks of the proxy
         then (no chat waits on paused workers), so reported apart, not as lost
  lost   anything else: an error status, a dropped connection, a stream cut short or without [DONE]
and counts in the phase during which it was sent; sent = ok + stale + mislabelled + refused + lost. The bar is
0 lost, 0 stale, 0 mislabelled. The fleet's version is the driver's own record: what the last push that succeeded
set; while a push runs both the old and the new version are the fleet's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

PHASES = ("steady", "nccl-primerl", "nccl-vllm", "failed-push", "join-wedge", "disk", "kill-b", "nccl-after",
          "proxy-restart", "replica", "findings-2-3")
WEDGE_S = 5.0  # join-wedge: the proxy's bound on the join nobody meets (prime-rl's /init_broadcaster `timeout`)
JOIN_GRACE_S = 2.0  # token_proxy/fleet/joins.py's: a join older than this makes chats a prompt 503
TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fleet_trainer.py")
USER = [{"role": "user", "content": "Write a short poem about the sea."}]


# --- the ledger (pure) -------------------------------------------------------------------------------

class VersionClock:
    """The versions the fleet held over time: spans [start, next start) each with its set of versions."""

    def __init__(self, version: str, now: float):
        self.spans: list[tuple[float, frozenset]] = [(now, frozenset({version}))]

    @property
    def current(self) -> frozenset:
        return self.spans[-1][1]

    def set(self, versions, now: float) -> None:
        self.spans.append((now, frozenset(versions)))

    def held_between(self, start: float, end: float) -> frozenset:
        held: set = set()
        for i, (since, versions) in enumerate(self.spans):
            until = self.spans[i + 1][0] if i + 1 < len(self.spans) else float("inf")
            if since <= end and until > start:
                held |= versions
        return frozenset(held)


@dataclass
class Rollout:
    phase: str
    stream: bool
    sent: float
    done: float
    fate: str  # ok | stale | lost (mislabelled is decided per phase: rows_of)
    reason: str = ""
    version: str | None = None
    via: str = ""  # the proxy it went through


def last_version(choice: dict) -> str | None:
    spans = choice.get("weight_versions") or []
    return spans[-1].get("version") if spans else None


def judge_whole(status: int, body, max_tokens: int) -> tuple[str, str, str | None]:
    """(fate before the version check: ok | lost, reason, version) of a non-streamed chat."""
    if status != 200:
        message = body.get("error", {}).get("message", "") if isinstance(body, dict) else str(body)[:200]
        return "lost", f"{status}: {message}"[:200], None
    try:
        choice = body["choices"][0]
    except (TypeError, KeyError, IndexError):
        return "lost", "200 without choices", None
    ids = choice.get("token_ids") or []
    version = last_version(choice)
    if len(ids) != max_tokens:
        return "lost", f"{len(ids)} of {max_tokens} tokens ({choice.get('finish_reason')})", version
    return "ok", "", version


def parse_sse(raw: bytes) -> tuple[list, bool]:
    """(events as JSON objects, whether `data: [DONE]` came)."""
    events, done = [], False
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        try:
            events.append(json.loads(data))
        except ValueError:
            events.append({"error": {"message": f"not JSON: {data[:80]}"}})
    return events, done


def judge_stream(status: int, raw: bytes, max_tokens: int) -> tuple[str, str, str | None]:
    if status != 200:
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
        return judge_whole(status, body, max_tokens)
    events, done = parse_sse(raw)
    errors = [e for e in events if "error" in e]
    if errors:
        return "lost", f"error event: {errors[0]['error'].get('message', '')}"[:200], None
    choices = [e["choices"][0] for e in events if e.get("choices")]
    ids = [t for c in choices for t in (c.get("token_ids") or [])]
    version = next((v for v in (last_version(c) for c in reversed(choices)) if v is not None), None)
    finish = next((c.get("finish_reason") for c in reversed(choices) if c.get("finish_reason")), None)
    if not done:
        return "lost", "stream without [DONE]", version
    if len(ids) != max_tokens:
        return "lost", f"stream cut: {len(ids)} of {max_tokens} tokens ({finish})", version
    return "ok", "", version


def with_version(fate: str, reason: str, version: str | None, held: frozenset) -> tuple[str, str]:
    """An answer that is whole but on a version the fleet did not hold while it ran is stale."""
    if fate == "ok" and version not in held:
        return "stale", f"served {version!r} while the fleet held {sorted(held)}"
    return fate, reason


@dataclass
class PhaseRow:
    phase: str
    seconds: float = 0.0  # the phase's action (push, restart, ...), not the load windows around it
    sent: int = 0
    ok: int = 0
    lost: int = 0
    stale: int = 0
    streamed: int = 0
    steps: list = field(default_factory=list)  # what the phase did: "POST /pause 200 0.01s", ...
    reasons: dict = field(default_factory=dict)  # the lost and stale, by reason, most frequent first
    served: dict = field(default_factory=dict)  # weight version -> whole replies that carried it
    passed: bool = False
    mislabelled: int = 0
    refused: int = 0


def fate_of(rollout: Rollout, mislabelled: frozenset) -> str:
    """A whole answer whose label was seen on weights that are not that version's is mislabelled."""
    if rollout.fate in ("ok", "stale") and rollout.version in mislabelled:
        return "mislabelled"
    return rollout.fate


def rows_of(phases: list[str], rollouts: list[Rollout], actions: dict,
            mislabelled: dict | None = None) -> list[PhaseRow]:
    """One row per phase, in order; `actions[phase]` = (seconds, steps, action_ok); `mislabelled[phase]`: the
    version labels seen on weights not that version's during the phase."""
    rows = []
    for phase in phases:
        mine = [r for r in rollouts if r.phase == phase]
        bad = frozenset((mislabelled or {}).get(phase, ()))
        fates = Counter(fate_of(r, bad) for r in mine)
        reasons = Counter(r.reason or f"label {r.version!r} on other weights" for r in mine
                          if fate_of(r, bad) != "ok")
        seconds, steps, action_ok = actions.get(phase, (0.0, [], True))
        served = Counter(str(r.version) for r in mine if r.fate != "lost")
        row = PhaseRow(phase, round(seconds, 2), len(mine), fates["ok"], fates["lost"], fates["stale"],
                       sum(r.stream for r in mine), list(steps), dict(reasons.most_common(5)), dict(served),
                       mislabelled=fates["mislabelled"], refused=fates["refused"])
        row.passed = action_ok and row.lost == 0 and row.stale == 0 and row.mislabelled == 0 and row.sent > 0
        rows.append(row)
    return rows


def markdown(rows: list[PhaseRow], title: str) -> str:
    lines = [f"### {title}", "",
             "| phase | seconds | sent | ok | lost | served stale | mislabelled | refused | streamed | pass |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    lines.extend(f"| {r.phase} | {r.seconds:.2f} | {r.sent} | {r.ok} | {r.lost} | {r.stale} | {r.mislabelled} | "
                 f"{r.refused} | {r.streamed} | {'yes' if r.passed else 'NO'} |" for r in rows)
    lines.append("")
    for r in rows:
        lines.append(f"- **{r.phase}**: " + "; ".join(r.steps) + f"; versions served {r.served}")
        for reason, count in r.reasons.items():
            lines.append(f"  - {count} x {reason}")
    return "\n".join(lines) + "\n"


# --- the run (I/O) -----------------------------------------------------------------------------------

HEALED_EVENT = "healed"


def fence_counts(metrics: str) -> dict:
    """{event: count} of token_proxy_fence_events_total in a /metrics text (pure)."""
    counts = {}
    for line in metrics.splitlines():
        if line.startswith("token_proxy_fence_events_total{"):
            labels, _, value = line.rpartition(" ")
            event = labels.split('event="', 1)[1].split('"', 1)[0]
            counts[event] = float(value)
    return counts


def free_port() -> int:
    """A free port for a trainer's store, below the kernel's ephemeral range: a port the kernel hands out
    (bind to 0) is free only until the next outgoing connection, and the rollout load opens thousands of
    them. On the GPU round the trainer's second group failed to listen (EADDRINUSE) on a port picked that way,
    and SGLang's workers then sat in /init_weights_update_group, unable to serve, for minutes."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for port in random.sample(range(20000, min(low, 32768)), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


class Load:
    """`concurrency` clients, each sending chats back to back, streamed and not in turn; client i goes
    through proxies[i % len(proxies)]. `hold()` stops new sends and waits for those in flight."""

    def __init__(self, session, proxy: str, clock: VersionClock, concurrency: int, max_tokens: int,
                 timeout_s: float):
        self.session, self.proxies, self.clock = session, [proxy], clock
        self.concurrency, self.max_tokens, self.timeout_s = concurrency, max_tokens, timeout_s
        self.phase = "steady"
        self.rollouts: list[Rollout] = []
        self._stop = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        self._in_flight = 0
        self._tasks: list[asyncio.Task] = []
        self.no_healthy = False  # the driver left no healthy worker: a prompt 503 is what is asked (refused)

    async def hold(self) -> int:
        """No new rollout is sent until release(); returns once none is in flight (bounded by the request
        timeout); the number still in flight then (0 unless one hangs)."""
        self._open.clear()
        deadline = time.monotonic() + self.timeout_s + 5
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._in_flight

    def release(self) -> None:
        self._open.set()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.concurrency)]

    async def _client(self, index: int) -> None:
        for n in itertools.count():
            if self._stop.is_set():
                return
            if not self._open.is_set():
                await self._open.wait()
                continue
            self._in_flight += 1
            try:
                await self.one(stream=(index + n) % 2 == 0, proxy=self.proxies[index % len(self.proxies)])
            finally:
                self._in_flight -= 1

    async def stop(self) -> None:
        self._stop.set()
        self._open.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def one(self, stream: bool, proxy: str) -> Rollout:
        import aiohttp

        phase, sent = self.phase, time.monotonic()
        body = {"messages": USER, "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 1.0,
                "return_token_ids": True, "stream": stream}
        try:
            async with self.session.post(f"{proxy}/v1/chat/completions", json=body,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                raw = await resp.read()
                status, retry_after = resp.status, resp.headers.get("Retry-After")
            if stream:
                fate, reason, version = judge_stream(status, raw, self.max_tokens)
            else:
                try:
                    parsed = json.loads(raw)
                except ValueError:
                    parsed = raw.decode("utf-8", "replace")
                fate, reason, version = judge_whole(status, parsed, self.max_tokens)
            if fate == "lost" and status == 503 and retry_after and self.no_healthy:
                fate = "refused"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            fate, reason, version = "lost", f"no answer: {type(exc).__name__} {exc}"[:200], None
        done = time.monotonic()
        fate, reason = with_version(fate, reason, version, self.clock.held_between(sent, done))
        rollout = Rollout(phase, stream, sent, done, fate, reason, version, proxy)
        self.rollouts.append(rollout)
        if fate in ("lost", "refused") and self._stop.is_set() is False:
            await asyncio.sleep(0.05)  # a dead fleet must not become a busy loop
        return rollout


class TrainerProcess:
    """bench/fleet_trainer.py as a child: send a command, read its answer (bounded); a trainer that does not
    answer in time is killed and a fresh one started (and the command reported failed)."""

    def __init__(self, argv: list[str], env: dict, log_path: str):
        self.argv, self.env, self.log_path = argv, env, log_path
        self.proc: asyncio.subprocess.Process | None = None
        self._log = None

    async def start(self, timeout_s: float = 180.0) -> dict:
        self._log = self._open_log()
        self.proc = await asyncio.create_subprocess_exec(*self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                         stderr=self._log, env=self.env)
        return await self.answer(timeout_s)

    def _open_log(self):
        return open(self.log_path, "ab")  # kept open: the child writes its stderr there

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())

    async def answer(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), max(left, 0.01))
            except asyncio.TimeoutError:
                await self.restart()
                return {"ok": False, "error": f"trainer did not answer within {timeout_s:g} s (killed, restarted)"}
            if not line:
                code = await self.proc.wait()
                await self.restart()
                return {"ok": False, "error": f"trainer exited ({code}); restarted"}
            text = line.decode("utf-8", "replace")
            if text.startswith("@@ "):
                return json.loads(text[3:])
            self._log.write(line)

    async def call(self, cmd: dict, timeout_s: float) -> dict:
        self.send(cmd)
        return await self.answer(timeout_s)

    async def restart(self) -> None:
        await self.kill()
        await self.start()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


class Round:
    def __init__(self, args, session, load: Load, clock: VersionClock, trainer: TrainerProcess):
        self.args, self.session, self.load, self.clock, self.trainer = args, session, load, clock, trainer
        self.steps: list[str] = []
        self.ok = True
        self.versions = itertools.count(1)
        self.checksums: dict[str, str] = {}  # weight version -> the weights checksum it landed with
        self.mislabelled: dict[str, set] = {}  # phase -> version labels seen on other weights
        self.base_path: str | None = None  # the model path the workers started from (a reset loads it)

    # -- helpers

    def note(self, text: str, ok: bool = True) -> None:
        self.steps.append(text if ok else f"FAILED {text}")
        self.ok = self.ok and ok
        print(f"  [{self.load.phase}] {self.steps[-1]}", flush=True)

    async def admin(self, method: str, path: str, body=None, expect=(200,), timeout_s: float | None = None,
                    proxy: str | None = None):
        import aiohttp

        started = time.monotonic()
        where = "" if proxy in (None, self.args.proxy) else f" via {proxy}"
        try:
            async with self.session.request(method, f"{proxy or self.args.proxy}{path}", json=body,
                                            timeout=aiohttp.ClientTimeout(total=timeout_s or self.args.admin_timeout)
                                            ) as resp:
                status, raw = resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            status, raw = 0, f"{type(exc).__name__} {exc}".encode()
        try:
            reply = json.loads(raw) if raw else None
        except ValueError:
            reply = raw.decode("utf-8", "replace")
        text = json.dumps(reply)[:300] if reply is not None else ""
        self.note(f"{method} {path}{where} {status} {time.monotonic() - started:.2f}s {text}", status in expect)
        return status, reply

    def trainer_note(self, what: str, reply: dict, expect_ok: bool = True) -> dict:
        detail = "ok" if reply.get("ok") else reply.get("error", "")
        self.note(f"trainer {what}: {detail} ({reply.get('seconds', 0)}s)", bool(reply.get("ok")) == expect_ok)
        return reply

    async def worker_versions(self) -> list:
        import aiohttp

        versions = []
        for url in self.args.worker:
            try:
                async with self.session.get(f"{url}/model_info", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    versions.append((await resp.json()).get("weight_version"))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                versions.append(f"unreachable ({type(exc).__name__})")
        return versions

    async def check_fleet(self, version: str) -> None:
        """Every worker reports `version`, and the proxy's /weight_info says so, consistently; the weights
        under each label are that label's (audit)."""
        versions = await self.worker_versions()
        self.note(f"workers report {versions}", all(v == version for v in versions))
        await self.admin("GET", "/weight_info")
        await self.audit()

    async def checksum(self, url: str) -> str | None:
        """SGLang's weights checksum of one worker (/weights_checker), None when it cannot be read."""
        import aiohttp

        try:
            async with self.session.post(f"{url}/weights_checker", json={"action": "checksum"},
                                         timeout=aiohttp.ClientTimeout(total=20)) as resp:
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return None
        return body.get("per_engine_checksum") if isinstance(body, dict) and resp.status == 200 else None

    async def audit(self) -> None:
        """Each worker's (weight version, weights checksum). The first time a version is seen, with every
        worker that reports it on one checksum, that checksum is the version's; afterwards a worker whose
        checksum differs under that label is MISLABELLED (noted against the phase)."""
        versions = await self.worker_versions()
        sums = [await self.checksum(url) for url in self.args.worker]
        by_version: dict = {}
        for version, digest in zip(versions, sums):
            if digest is not None:
                by_version.setdefault(version, set()).add(digest)
        for version, digests in by_version.items():
            known = self.checksums.get(version)
            if known is None and len(digests) == 1:
                self.checksums[version] = next(iter(digests))
            elif known is None or digests != {known}:
                self.mislabelled.setdefault(self.load.phase, set()).add(version)
                self.note(f"weights under label {version!r} are not that version's: checksums {sorted(digests)} "
                          f"(recorded {known})", False)
        self.note("weights audit: " + ", ".join(f"{v}={(d or 'unread')[:10]}" for v, d in zip(versions, sums)))

    async def fleet_version(self, proxy: str | None = None) -> str | None:
        """The fleet's version as the controller (or a follower's copy) records it: GET /fleet/versions."""
        status, reply = await self.admin("GET", "/fleet/versions?seen=-1&wait=0", proxy=proxy)
        return (reply.get("record") or {}).get("current") if status == 200 and isinstance(reply, dict) else None

    async def fence_events(self, proxy: str) -> dict:
        """token_proxy_fence_events_total{event} of one proxy's /metrics (absent events: none)."""
        import aiohttp

        try:
            async with self.session.get(f"{proxy}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return {"unreadable": str(exc)}
        return fence_counts(text)

    # -- proxies and workers behind the proxies' back

    def controller_args(self) -> str:
        return f"--backend {self.args.router} " + " ".join(f"--worker {w}" for w in self.args.worker)

    async def proxy_script(self, what: str) -> bool:
        started = time.monotonic()
        done = await asyncio.to_thread(subprocess.run, f"{self.args.proxy_script} {what}", shell=True,
                                       check=False, executable="/bin/bash", capture_output=True, text=True)
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
        self.note(f"proxy {what.split(' --')[0]}: exit {done.returncode} {time.monotonic() - started:.1f}s {tail[0]}",
                  done.returncode == 0)
        return done.returncode == 0

    async def restart_controller(self) -> bool:
        await self.proxy_script("kill proxy")
        port = self.args.proxy.rsplit(":", 1)[1]
        return await self.proxy_script(f"start proxy {port} {self.controller_args()}")

    async def reset_worker(self, url: str, version: str = "default") -> None:
        """Behind every proxy's back: the start-up checkpoint loaded on the worker, directly on SGLang."""
        import aiohttp

        try:
            async with self.session.post(f"{url}/update_weights_from_disk", json={
                    "model_path": self.base_path, "weight_version": version},
                    timeout=aiohttp.ClientTimeout(total=self.args.admin_timeout)) as resp:
                status, text = resp.status, (await resp.text())[:200]
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            status, text = 0, str(exc)
        self.note(f"{url} reset to {version!r} directly on SGLang: {status} {text}", status == 200)

    async def serves_directly(self, url: str) -> bool:
        """The worker generates one token for a direct /generate within 15 s (it is not left paused)."""
        import aiohttp

        try:
            async with self.session.post(f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
                    "max_new_tokens": 1}}, timeout=aiohttp.ClientTimeout(total=15)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def held_load(self, why: str) -> None:
        left = await self.load.hold()
        self.note(f"load held ({why}): {left} rollouts still in flight", left == 0)

    def new_version(self, prefix: str) -> str:
        return f"{prefix}-{next(self.versions)}"

    # -- NCCL pushes

    async def primerl_step(self, version: str, mode: str, group: str, expect_ok: bool = True,
                           proxy: str | None = None, world: int | None = None) -> bool:
        """prime-rl's order: the orchestrator's /init_broadcaster with the trainer joining, /pause, /update_weights
        null while the trainer pushes, /resume; every call (the trainer's pushes too) through `proxy` (default:
        the controller), to `world` workers (default: all). Returns whether the push landed."""
        port = free_port()
        world = world or len(self.args.worker)
        self.trainer.send({"op": "init", "port": port, "group": group, "world": world, "announce": False,
                           "url": proxy or self.args.proxy})
        status, _ = await self.admin("POST", "/init_broadcaster", {
            "host": "127.0.0.1", "port": port, "timeout": self.args.push_timeout, "rank_offset": 0,
            "inference_world_size": world, "backend": self.args.backend, "group_name": group}, proxy=proxy)
        # a refused /init_broadcaster leaves the trainer waiting for peers that never come: give it 5 s, then
        # restart it (as a trainer would give up), rather than its whole join timeout
        wait_s = self.args.push_timeout + 20 if status == 200 else 5
        joined = self.trainer_note("init (announce=False)", await self.trainer.answer(wait_s), expect_ok=status == 200)
        if status != 200 or not joined.get("ok"):
            await self.close_group(group, proxy)
            return False
        return await self.push_and_resume(version, mode, group, expect_ok, proxy, world == len(self.args.worker))

    async def push_and_resume(self, version: str, mode: str, group: str, expect_ok: bool,
                              proxy: str | None = None, whole_fleet: bool = True) -> bool:
        old = self.clock.current
        await self.admin("POST", "/pause", proxy=proxy)
        self.clock.set(old | {version}, time.monotonic())
        update = asyncio.create_task(self.admin("POST", "/update_weights", {"weight_dir": None},
                                                expect=(200,) if expect_ok else (400, 409, 500, 502, 503),
                                                timeout_s=self.args.push_timeout + 30, proxy=proxy))
        seed = int(version.rsplit("-", 1)[-1]) if version.rsplit("-", 1)[-1].isdigit() else 1
        pushed = await self.trainer.call({"op": "push", "version": version, "mode": mode, "seed": seed},
                                         self.args.push_timeout + 20)
        self.trainer_note(f"push {mode} {version}", pushed, expect_ok)
        status, _ = await update
        landed = bool(pushed.get("ok")) and status == 200
        self.clock.set({version} if landed else old, time.monotonic())
        # a fleet held after a failed push answers 409 here (issue 28, point 6); today's main resumes
        await self.admin("POST", "/resume", expect=(200,) if landed else (200, 409), proxy=proxy)
        if landed and whole_fleet:
            await self.check_fleet(version)
        return landed

    async def close_group(self, group: str, proxy: str | None = None) -> None:
        """The trainer leaves its side; the proxy destroys the workers' side (an error is noted, not fatal)."""
        self.trainer_note("close", await self.trainer.call({"op": "close", "announce": False}, 60))
        await self.admin("POST", "/destroy_weights_update_group", {"group_name": group}, expect=(200, 400),
                         proxy=proxy)

    # -- phases

    async def steady(self) -> None:
        await self.admin("GET", "/weight_info")

    async def nccl_primerl(self) -> None:
        version = self.new_version("nccl")
        if await self.primerl_step(version, "perturb", "fleet-primerl"):
            await self.close_group("fleet-primerl")
        env = await self.trainer.call({"op": "env"}, 30)
        # NCCL_CUMEM_ENABLE as the trainer's broadcaster left it (nobody set it by hand: issue 28, point 2)
        self.note(f"trainer NCCL_CUMEM_ENABLE after the push: {env.get('NCCL_CUMEM_ENABLE')!r}")

    async def nccl_vllm(self) -> None:
        version = self.new_version("vllm")
        port = free_port()
        world = len(self.args.worker)
        reply = self.trainer_note("vllm trainer_init", await self.trainer.call(
            {"op": "vllm_init", "port": port, "world": world}, self.args.push_timeout + 30))
        if not reply.get("ok"):
            return
        old = self.clock.current
        await self.admin("POST", "/pause?mode=keep")
        self.clock.set(old | {version}, time.monotonic())
        sent = self.trainer_note("vllm send_weights", await self.trainer.call(
            {"op": "vllm_send", "mode": "perturb", "seed": 11}, self.args.push_timeout + 20))
        status, _ = await self.admin("POST", "/finish_weight_update", {"weight_version": version})
        landed = bool(sent.get("ok")) and status == 200
        self.clock.set({version} if landed else old, time.monotonic())
        await self.admin("POST", "/resume")
        if landed:
            await self.check_fleet(version)
        self.trainer_note("vllm shutdown", await self.trainer.call({"op": "vllm_shutdown"}, 60))

    async def failed_push(self) -> None:
        group = "fleet-retry"
        version = self.new_version("bad")
        self.load.no_healthy = True  # held after the failed push until the retry lands: a prompt 503 is asked
        await self.primerl_step(version, "wrong", group, expect_ok=False)
        await self.admin("GET", "/weight_info")
        self.trainer_note("close after the failure", await self.trainer.call({"op": "close", "announce": False}, 60))
        # the retry: the same group name, a new join and push (the proxy must have destroyed the old group)
        retry = self.new_version("retry")
        landed = await self.primerl_step(retry, "perturb", group)
        self.load.no_healthy = False
        if landed:
            await self.close_group(group)
        else:
            await self.admin("POST", "/resume?force=true", expect=(200, 409))

    async def join_wedge(self) -> None:
        group, port, world = "fleet-wedge", free_port(), len(self.args.worker)
        self.load.no_healthy = True  # both workers sit in the join: a prompt 503 is what is asked
        # a chat sent within the join's first 2 s (fleet/joins.py's grace, which spares healthy joins) waits for
        # its end: held back until then, so the rollouts show what comes after (tests/fleet/test_join_wedge.py
        # covers those that wait)
        await self.held_load("until the join is past its 2 s grace")
        wedge = asyncio.create_task(self.admin("POST", "/init_broadcaster", {
            "host": "127.0.0.1", "port": port, "timeout": WEDGE_S, "rank_offset": 0, "inference_world_size": world,
            "backend": self.args.backend, "group_name": group}, expect=(504,), timeout_s=WEDGE_S + 30))
        await asyncio.sleep(JOIN_GRACE_S + 0.5)
        self.load.release()
        await wedge
        _, info = await self.admin("GET", "/weight_info")
        joining = sorted(j["url"] for j in (info or {}).get("joining", []) if isinstance(j, dict))
        self.note(f"/weight_info joining {joining}", joining == sorted(self.args.worker))
        await asyncio.sleep(3.0)  # the load meets the wedge
        self.trainer.send({"op": "init", "port": port, "group": group, "world": world, "announce": False,
                           "url": self.args.proxy})
        self.trainer_note("late init (announce=False)", await self.trainer.answer(self.args.push_timeout + 20))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            _, info = await self.admin("GET", "/weight_info")
            if isinstance(info, dict) and not info.get("joining"):
                break
            await asyncio.sleep(1.0)
        self.note(f"joins answered after the late trainer: {not (info or {}).get('joining')}",
                  not (info or {}).get("joining"))
        self.trainer_note("close", await self.trainer.call({"op": "close", "announce": False}, 60))
        self.load.no_healthy = False
        version = self.new_version("after-wedge")
        if await self.primerl_step(version, "perturb", group):  # the same name: the late group was destroyed
            await self.close_group(group)

    async def disk(self) -> None:
        version = self.new_version("disk")
        where = os.path.join(self.args.checkpoints, f"step_{version}")
        self.trainer_note(f"save {where}", await self.trainer.call({"op": "save", "dir": where, "seed": 5}, 300))
        old = self.clock.current
        await self.admin("POST", "/pause")
        self.clock.set(old | {version}, time.monotonic())
        status, _ = await self.admin("POST", "/update_weights", {"weight_dir": where, "weight_version": version,
                                                                 "verify": "checksum"},
                                     timeout_s=self.args.push_timeout + 60)
        self.clock.set({version} if status == 200 else old, time.monotonic())
        await self.admin("POST", "/resume")
        if status == 200:
            await self.check_fleet(version)

    async def kill_b(self) -> None:
        killed = time.monotonic()
        code = subprocess.run(self.args.kill_b, shell=True, check=False,  # noqa: ASYNC221
                              executable="/bin/bash").returncode
        self.note(f"kill -9 worker B: exit {code}", code == 0)
        await asyncio.sleep(self.args.dead_s)
        started = time.monotonic()
        code = await asyncio.to_thread(subprocess.run, self.args.restart_b, shell=True, check=False,
                                       executable="/bin/bash")
        self.note(f"restart worker B: exit {code.returncode} after {time.monotonic() - started:.1f}s",
                  code.returncode == 0)
        await self.wait_healthy(self.args.worker[-1], self.args.restart_timeout)
        # rollouts go on with B back: sglang-router sends it traffic again once its circuit breaker closes (60 s
        # after the failures by default), so the window runs until --after-kill-s after the kill, 10 s at least
        await asyncio.sleep(max(10.0, self.args.after_kill_s - (time.monotonic() - killed)))
        await self.check_fleet(next(iter(sorted(self.clock.current))))

    async def nccl_after(self) -> None:
        version = self.new_version("nccl")
        if await self.primerl_step(version, "perturb", "fleet-after"):
            await self.close_group("fleet-after")

    async def proxy_restart(self) -> None:
        """Between two NCCL steps the controller is killed (-9) and started again over the same workers."""
        before = self.new_version("nccl")
        if await self.primerl_step(before, "perturb", "fleet-restart-1"):
            await self.close_group("fleet-restart-1")
        await self.held_load("the controller is killed and restarted")
        await self.restart_controller()
        workers = await self.worker_versions()
        status, info = await self.admin("GET", "/weight_info")
        label = info.get("weight_version") if isinstance(info, dict) else None
        self.note(f"after the restart: /weight_info {label!r}, workers {workers} (no relabel: the same)",
                  status == 200 and all(v == label for v in workers) and label == before)
        events = await self.fence_events(self.args.proxy)
        self.note(f"restarted controller's fence events {events}", not any(events.values()))
        await self.audit()
        self.load.release()
        await asyncio.sleep(self.args.window_s)
        after = self.new_version("nccl")
        if await self.primerl_step(after, "perturb", "fleet-restart-2"):
            await self.close_group("fleet-restart-2")

    async def replica(self) -> None:
        """A follower in front of the same router: half the rollouts through it; a push through the controller,
        then one whose admin calls all go to the follower (forwarded: the controller's record moves)."""
        port = free_port()
        follower = f"http://127.0.0.1:{port}"
        if not await self.proxy_script(f"start replica {port} {self.controller_args()} "
                                       f"--fleet-controller {self.args.proxy}"):
            return
        self.load.proxies = [self.args.proxy, follower]
        await asyncio.sleep(self.args.window_s)
        first = self.new_version("nccl")
        if await self.primerl_step(first, "perturb", "fleet-replica-1"):
            await self.close_group("fleet-replica-1")
        await self.both_report(first, follower)
        second = self.new_version("nccl")
        if await self.primerl_step(second, "perturb", "fleet-replica-2", proxy=follower):
            await self.close_group("fleet-replica-2", follower)
        recorded = await self.fleet_version()
        self.note(f"the controller's record after the push sent to the follower: {recorded!r}", recorded == second)
        await self.both_report(second, follower)
        await asyncio.sleep(self.args.window_s)
        events = await self.fence_events(follower)
        self.note(f"follower's fence events {events} (a follower never fences or heals)", not any(events.values()))
        via = Counter(r.via == follower for r in self.load.rollouts if r.phase == "replica")
        self.note(f"rollouts through the follower {via[True]}, through the controller {via[False]}", via[True] > 0)
        await self.held_load("the follower is stopped")
        self.load.proxies = [self.args.proxy]
        self.load.release()
        await self.proxy_script("kill replica")

    async def both_report(self, version: str, follower: str) -> None:
        for proxy in (self.args.proxy, follower):
            status, info = await self.admin("GET", "/weight_info", proxy=proxy)
            label = info.get("weight_version") if isinstance(info, dict) else None
            self.note(f"/weight_info{'' if proxy == self.args.proxy else ' via the follower'}: {label!r}",
                      status == 200 and label == version)

    async def findings_2_3(self) -> None:
        await self.finding_2()
        await self.finding_3()

    async def finding_2(self) -> None:
        """Issue 37, finding 2: A on a version pushed over NCCL through another proxy, B on 'default'; a new
        controller over both must not relabel (A keeps its label and weights; B is held, never healed)."""
        await self.held_load("the controller is replaced")
        await self.proxy_script("kill proxy")
        worker_a, worker_b = self.args.worker[0], self.args.worker[-1]
        await self.reset_worker(worker_b)
        port = free_port()
        other = f"http://127.0.0.1:{port}"
        pushed = self.new_version("other")
        if (await self.proxy_script(f"start other {port} --backend {worker_a}")
                and await self.primerl_step(pushed, "perturb", "fleet-other", proxy=other, world=1)):
            await self.close_group("fleet-other", other)
        await self.proxy_script("kill other")
        await self.audit()  # records the pushed version's checksum on A, and 'default' on B
        port = self.args.proxy.rsplit(":", 1)[1]
        await self.proxy_script(f"start proxy {port} {self.controller_args()}")
        fenced = await self.wait_fenced({worker_b}, 20.0)
        workers = await self.worker_versions()
        recorded = await self.fleet_version()
        self.note(f"new controller over [{pushed!r}, 'default']: fleet version {recorded!r}, workers {workers}, "
                  f"fenced {sorted(fenced)}", recorded == pushed and workers == [pushed, "default"]
                  and worker_b in fenced)
        events = await self.fence_events(self.args.proxy)
        self.note(f"fence events {events} (held, never healed)", not events.get(HEALED_EVENT))
        await self.audit()
        self.clock.set({pushed}, time.monotonic())
        self.load.release()
        await asyncio.sleep(self.args.window_s)

    async def finding_3(self) -> None:
        """Issue 37, finding 3: both workers reset to 'default' directly on SGLang, then a disk transaction
        (verify checksum) under the load: 0 lost, no worker left paused, /weight_info consistent."""
        version = self.new_version("disk")
        where = os.path.join(self.args.checkpoints, f"step_{version}")
        self.trainer_note(f"save {where}", await self.trainer.call({"op": "save", "dir": where, "seed": 7}, 300))
        await self.held_load("both workers are reset behind the proxy's back")
        self.load.no_healthy = True  # until the transaction lets them back in: a prompt 503 is the answer
        for url in self.args.worker:
            await self.reset_worker(url)
        old = self.clock.current
        await self.admin("POST", "/pause")
        self.clock.set(old | {version}, time.monotonic())
        self.load.release()  # the rollouts wait on the paused fleet, and land on the transaction's version
        status, _ = await self.admin("POST", "/update_weights", {"weight_dir": where, "weight_version": version,
                                                                 "verify": "checksum"},
                                     timeout_s=self.args.push_timeout + 60)
        self.clock.set({version} if status == 200 else old, time.monotonic())
        await self.admin("POST", "/resume")
        left = await self.wait_fenced(set(), 20.0, until_empty=True)
        self.load.no_healthy = False
        self.note(f"fenced after the transaction: {sorted(left)}", not left)
        await asyncio.sleep(self.args.window_s)
        await self.check_fleet(version)
        status, info = await self.admin("GET", "/weight_info")
        self.note(f"/weight_info consistent {info.get('consistent') if isinstance(info, dict) else None}, fenced "
                  f"{info.get('fenced') if isinstance(info, dict) else None}",
                  isinstance(info, dict) and info.get("consistent") is True and not info.get("fenced"))
        serving = [await self.serves_directly(url) for url in self.args.worker]
        self.note(f"each worker answers a direct /generate (none left paused): {serving}", all(serving))

    async def wait_fenced(self, urls: set, timeout_s: float, until_empty: bool = False) -> set:
        """The controller's /weight_info `fenced` urls, once they include `urls` (or none is left, with
        `until_empty`), or at the deadline."""
        import aiohttp

        deadline, fenced = time.monotonic() + timeout_s, set()
        while time.monotonic() < deadline:
            try:
                async with self.session.get(f"{self.args.proxy}/weight_info",
                                            timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    fenced = {f.get("url") for f in (await resp.json()).get("fenced", [])}
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                fenced = set()
            if (not fenced) if until_empty else urls <= fenced:
                break
            await asyncio.sleep(0.25)
        return fenced

    async def wait_healthy(self, url: str, timeout_s: float) -> None:
        import aiohttp

        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            try:
                async with self.session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        self.note(f"{url} healthy after {time.monotonic() - started:.1f}s")
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
            await asyncio.sleep(0.5)
        self.note(f"{url} not healthy after {timeout_s:g}s", False)


async def run(args) -> list[PhaseRow]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(f"{args.worker[0]}/model_info", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            info = await resp.json()
            initial = info.get("weight_version") or "default"
        clock = VersionClock(initial, time.monotonic())
        env = dict(os.environ)  # the trainer's default environment: nothing NCCL-specific is added here
        if args.trainer_gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = args.trainer_gpu
        argv = [args.trainer_python, TRAINER,
                "--url", args.proxy, "--weights", args.weights, "--backend", args.backend,
                "--timeout", str(args.push_timeout)]
        if args.device:
            argv += ["--device", args.device]
        trainer = TrainerProcess(argv, env, args.trainer_log)
        load = Load(session, args.proxy, clock, args.concurrency, args.max_tokens, args.request_timeout)
        round_ = Round(args, session, load, clock, trainer)
        # the checkpoint the workers started from: /server_info's (SGLang's /model_info names the last one loaded)
        async with session.get(f"{args.worker[0]}/server_info", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            round_.base_path = (await resp.json()).get("model_path") or info.get("model_path")
        await round_.audit()  # the start-up version's checksum
        actions: dict = {}
        ready = await trainer.start()
        round_.trainer_note("start", ready)
        environment = await trainer.call({"op": "env"}, 60)
        print(f"trainer env: {environment}", flush=True)
        load.start()
        try:
            for phase in args.phases:
                load.phase, round_.steps, round_.ok = phase, [], True
                print(f"== {phase}", flush=True)
                await asyncio.sleep(args.window_s)
                started = time.monotonic()
                try:
                    await asyncio.wait_for(getattr(round_, phase.replace("-", "_"))(), args.phase_timeout)
                except asyncio.TimeoutError:
                    round_.note(f"phase did not end within {args.phase_timeout:g}s", False)
                except Exception as exc:  # noqa: BLE001 - report and go on to the next phase
                    round_.note(f"phase raised {type(exc).__name__}: {exc}", False)
                seconds = time.monotonic() - started
                load.release()  # a phase that failed while the load was held must not stop the round
                await asyncio.sleep(args.window_s)
                await round_.audit()
                actions[phase] = (seconds, round_.steps, round_.ok)
                write_out(args, rows_of([p for p in args.phases if p in actions], load.rollouts, actions,
                                        round_.mislabelled))
        finally:
            await load.stop()
            await trainer.kill()
        rows = rows_of(list(args.phases), load.rollouts, actions, round_.mislabelled)
        if rows:
            rows[0].steps.insert(0, f"trainer env {json.dumps(environment)[:300]}")
        return rows


def write_out(args, rows: list[PhaseRow]) -> str:
    """The table so far (after every phase: a run cut short by its time limit still leaves its rows)."""
    table = markdown(rows, args.title)
    if args.md_out:
        with open(args.md_out, "w") as f:
            f.write(table)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([row.__dict__ for row in rows], f, indent=1)
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", required=True)
    parser.add_argument("--worker", action="append", required=True, help="each SGLang worker (B last)")
    parser.add_argument("--weights", required=True, help="the model directory the workers serve, or 'sim'")
    parser.add_argument("--checkpoints", default="/tmp/fleet-ckpt", help="where the disk phase writes")
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--device", default=None, help="cuda with NCCL")
    parser.add_argument("--trainer-python", default=sys.executable)
    parser.add_argument("--trainer-gpu", default=None, help="CUDA_VISIBLE_DEVICES for the trainer")
    parser.add_argument("--trainer-log", default="/tmp/fleet-trainer.log")
    parser.add_argument("--kill-b", default="false", help="shell command that kills worker B with -9")
    parser.add_argument("--restart-b", default="false", help="shell command that starts worker B again")
    parser.add_argument("--router", default=None, help="sglang-router's URL (the proxies' --backend)")
    parser.add_argument("--proxy-script", default="bash tests/e2e/fleet_proxy.sh",
                        help="starts ('start NAME PORT FLAGS...') and kills ('kill NAME') a proxy; the controller "
                             "is NAME proxy on --proxy's port")
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--window-s", type=float, default=3.0, help="load alone before and after each action")
    parser.add_argument("--dead-s", type=float, default=3.0, help="seconds worker B stays dead")
    parser.add_argument("--after-kill-s", type=float, default=80.0,
                        help="rollouts go on until this long after the kill (sglang-router readmits B after 60 s)")
    parser.add_argument("--restart-timeout", type=float, default=240.0)
    parser.add_argument("--push-timeout", type=float, default=60.0)
    parser.add_argument("--admin-timeout", type=float, default=120.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--phase-timeout", type=float, default=240.0)
    parser.add_argument("--title", default="Fleet round")
    parser.add_argument("--md-out")
    parser.add_argument("--json-out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.proxy = args.proxy.rstrip("/")
    args.worker = [w.rstrip("/") for w in args.worker]
    needs_router = {"proxy-restart", "replica", "findings-2-3"} & set(args.phases)
    if needs_router and not args.router:
        raise SystemExit(f"--router is needed by the phases {sorted(needs_router)}")
    rows = asyncio.run(run(args))
    print(write_out(args, rows), flush=True)
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
