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
  disk          /pause, /update_weights {"weight_dir", "verify": "checksum"} (a checkpoint the trainer writes), /resume
  kill-b        worker B killed with -9, restarted, and the rollouts go on
  nccl-after    one more NCCL step (prime-rl's), the restarted worker included

Each rollout ends as:
  ok     a 200 with every token asked for (ignore_eos), on a weight version the fleet held while it ran
  stale  the same, but its (last) weight version is not one the fleet held while it ran
  lost   anything else: an error status, a dropped connection, a stream cut short or without [DONE]
and counts in the phase during which it was sent; sent = ok + stale + lost. The bar is 0 lost, 0 stale.
The fleet's version is the driver's own record: what the last push that succeeded set; while a push runs
both the old and the new version are the fleet's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

PHASES = ("steady", "nccl-primerl", "nccl-vllm", "failed-push", "disk", "kill-b", "nccl-after")
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
    fate: str  # ok | stale | lost
    reason: str = ""
    version: str | None = None


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


def rows_of(phases: list[str], rollouts: list[Rollout], actions: dict) -> list[PhaseRow]:
    """One row per phase, in order; `actions[phase]` = (seconds, steps, action_ok)."""
    rows = []
    for phase in phases:
        mine = [r for r in rollouts if r.phase == phase]
        fates = Counter(r.fate for r in mine)
        reasons = Counter(r.reason for r in mine if r.fate != "ok")
        seconds, steps, action_ok = actions.get(phase, (0.0, [], True))
        served = Counter(str(r.version) for r in mine if r.fate != "lost")
        row = PhaseRow(phase, round(seconds, 2), len(mine), fates["ok"], fates["lost"], fates["stale"],
                       sum(r.stream for r in mine), list(steps), dict(reasons.most_common(5)), dict(served))
        row.passed = action_ok and row.lost == 0 and row.stale == 0 and row.sent > 0
        rows.append(row)
    return rows


def markdown(rows: list[PhaseRow], title: str) -> str:
    lines = [f"### {title}", "", "| phase | seconds | sent | ok | lost | served stale | streamed | pass |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    lines.extend(f"| {r.phase} | {r.seconds:.2f} | {r.sent} | {r.ok} | {r.lost} | {r.stale} | {r.streamed} | "
                 f"{'yes' if r.passed else 'NO'} |" for r in rows)
    lines.append("")
    for r in rows:
        lines.append(f"- **{r.phase}**: " + "; ".join(r.steps) + f"; versions served {r.served}")
        for reason, count in r.reasons.items():
            lines.append(f"  - {count} x {reason}")
    return "\n".join(lines) + "\n"


# --- the run (I/O) -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Load:
    """`concurrency` clients, each sending chats back to back, streamed and not in turn."""

    def __init__(self, session, proxy: str, clock: VersionClock, concurrency: int, max_tokens: int,
                 timeout_s: float):
        self.session, self.proxy, self.clock = session, proxy, clock
        self.concurrency, self.max_tokens, self.timeout_s = concurrency, max_tokens, timeout_s
        self.phase = "steady"
        self.rollouts: list[Rollout] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.concurrency)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _client(self, index: int) -> None:
        for n in itertools.count():
            if self._stop.is_set():
                return
            await self.one(stream=(index + n) % 2 == 0)

    async def one(self, stream: bool) -> Rollout:
        import aiohttp

        phase, sent = self.phase, time.monotonic()
        body = {"messages": USER, "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 1.0,
                "return_token_ids": True, "stream": stream}
        try:
            async with self.session.post(f"{self.proxy}/v1/chat/completions", json=body,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                raw = await resp.read()
                status = resp.status
            if stream:
                fate, reason, version = judge_stream(status, raw, self.max_tokens)
            else:
                try:
                    parsed = json.loads(raw)
                except ValueError:
                    parsed = raw.decode("utf-8", "replace")
                fate, reason, version = judge_whole(status, parsed, self.max_tokens)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            fate, reason, version = "lost", f"no answer: {type(exc).__name__} {exc}"[:200], None
        done = time.monotonic()
        fate, reason = with_version(fate, reason, version, self.clock.held_between(sent, done))
        rollout = Rollout(phase, stream, sent, done, fate, reason, version)
        self.rollouts.append(rollout)
        if fate == "lost" and self._stop.is_set() is False:
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

    # -- helpers

    def note(self, text: str, ok: bool = True) -> None:
        self.steps.append(text if ok else f"FAILED {text}")
        self.ok = self.ok and ok
        print(f"  [{self.load.phase}] {self.steps[-1]}", flush=True)

    async def admin(self, method: str, path: str, body=None, expect=(200,), timeout_s: float | None = None):
        import aiohttp

        started = time.monotonic()
        try:
            async with self.session.request(method, f"{self.args.proxy}{path}", json=body,
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
        self.note(f"{method} {path} {status} {time.monotonic() - started:.2f}s {text}", status in expect)
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
        """Every worker reports `version`, and the proxy's /weight_info says so, consistently."""
        versions = await self.worker_versions()
        self.note(f"workers report {versions}", all(v == version for v in versions))
        await self.admin("GET", "/weight_info")

    def new_version(self, prefix: str) -> str:
        return f"{prefix}-{next(self.versions)}"

    # -- NCCL pushes

    async def primerl_step(self, version: str, mode: str, group: str, expect_ok: bool = True) -> bool:
        """prime-rl's order: the orchestrator's /init_broadcaster with the trainer joining, /pause, /update_weights
        null while the trainer pushes, /resume. Returns whether the push landed."""
        port = free_port()
        world = len(self.args.worker)
        self.trainer.send({"op": "init", "port": port, "group": group, "world": world, "announce": False})
        status, _ = await self.admin("POST", "/init_broadcaster", {
            "host": "127.0.0.1", "port": port, "timeout": self.args.push_timeout, "rank_offset": 0,
            "inference_world_size": world, "backend": self.args.backend, "group_name": group})
        # a refused /init_broadcaster leaves the trainer waiting for peers that never come: give it 5 s, then
        # restart it (as a trainer would give up), rather than its whole join timeout
        wait_s = self.args.push_timeout + 20 if status == 200 else 5
        joined = self.trainer_note("init (announce=False)", await self.trainer.answer(wait_s), expect_ok=status == 200)
        if status != 200 or not joined.get("ok"):
            await self.close_group(group)
            return False
        return await self.push_and_resume(version, mode, group, expect_ok)

    async def push_and_resume(self, version: str, mode: str, group: str, expect_ok: bool) -> bool:
        old = self.clock.current
        await self.admin("POST", "/pause")
        self.clock.set(old | {version}, time.monotonic())
        update = asyncio.create_task(self.admin("POST", "/update_weights", {"weight_dir": None},
                                                expect=(200,) if expect_ok else (400, 409, 500, 502, 503),
                                                timeout_s=self.args.push_timeout + 30))
        pushed = await self.trainer.call({"op": "push", "version": version, "mode": mode},
                                         self.args.push_timeout + 20)
        self.trainer_note(f"push {mode} {version}", pushed, expect_ok)
        status, _ = await update
        landed = bool(pushed.get("ok")) and status == 200
        self.clock.set({version} if landed else old, time.monotonic())
        # a fleet held after a failed push answers 409 here (issue 28, point 6); today's main resumes
        await self.admin("POST", "/resume", expect=(200,) if landed else (200, 409))
        if landed:
            await self.check_fleet(version)
        return landed

    async def close_group(self, group: str) -> None:
        """The trainer leaves its side; the proxy destroys the workers' side (an error is noted, not fatal)."""
        self.trainer_note("close", await self.trainer.call({"op": "close", "announce": False}, 60))
        await self.admin("POST", "/destroy_weights_update_group", {"group_name": group}, expect=(200, 400))

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
        await self.primerl_step(version, "wrong", group, expect_ok=False)
        await self.admin("GET", "/weight_info")
        self.trainer_note("close after the failure", await self.trainer.call({"op": "close", "announce": False}, 60))
        # the retry: the same group name, a new join and push (the proxy must have destroyed the old group)
        retry = self.new_version("retry")
        if await self.primerl_step(retry, "perturb", group):
            await self.close_group(group)
        else:
            await self.admin("POST", "/resume?force=true", expect=(200, 409))

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
            initial = (await resp.json()).get("weight_version") or "default"
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
                await asyncio.sleep(args.window_s)
                actions[phase] = (seconds, round_.steps, round_.ok)
                write_out(args, rows_of([p for p in args.phases if p in actions], load.rollouts, actions))
        finally:
            await load.stop()
            await trainer.kill()
        rows = rows_of(list(args.phases), load.rollouts, actions)
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
    rows = asyncio.run(run(args))
    print(write_out(args, rows), flush=True)
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
