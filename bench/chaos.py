"""The chaos ledger: a trainer's rhythm (bursts of concurrent requests, idle gaps) through the proxy while
faults happen, one at a time and then together, with every request's fate written down.

Every request ends in one of:
  ids     answered as asked, checked strictly: every sample (n) with the ids and finish reason its request
          calls for (max_tokens N with ignore_eos: exactly N ids and "length"; without: "length" with N
          ids or "stop" with at most N), a stream with [DONE] after them; an admin call: 200 with the body
          its API documents (/sleep: {"status": "sleeping", "level": L}, ...)
  aborted a sample that ended with finish_reason "abort" while an admin call that aborts requests by
          design was under way (vLLM's /sleep, /pause?mode=abort, /abort_requests); anywhere else an
          aborted sample is lost
  error   answered with an error the client can act on: a status and a message that say what to do,
          Retry-After on a 429/503 (SGLang unreachable or restarting, the proxy at capacity); SGLang's
          own 502/504; a 409 to an admin call (its message names the call to make first); or, in a stream
          already under way, an error event naming SGLang's failure
  lost    no answer (a hang past the client's limit, a connection the proxy dropped), a 500 or another
          5xx that is the proxy's own doing, a 429/503 without Retry-After, another 4xx (the requests are
          valid), a 200 with fewer or more ids or samples than asked or the wrong finish reason, a stream
          that ends without [DONE] or an error event, an admin 200 whose body is not the documented one
  left    the client itself left mid-stream (the fault "client disconnects")
  cut     in flight on a proxy worker killed with -9 (the kernel resets its connections at once: no
          process is left that could answer); counted apart from lost, and only within 2 s of the kill
The bar is 0 lost.

Faults (the simulator closes idle keep-alive connections late, as SGLang's uvicorn does, in every run;
the gaps sweep across its keep-alive):
  keepalive          nothing else
  keepalive_pool_30s nothing else, the proxy's pool kept 30 s (as before --backend-keepalive): retries
  sglang_kill        kill -9 the SGLang simulator mid-burst, start it again on the same port
  weights_primerl    prime-rl's POST /update_weights {"weight_dir"} mid-burst
  weights_vllm       vLLM's POST /pause?mode=keep, /update_weight_version, /resume mid-burst
  sleep_wake         vLLM's POST /sleep?level=1 then /wake_up (no tags) mid-burst
  client_disconnect  a third of the burst's streams leave after their first chunk
  sigterm_deadline   SIGTERM to a proxy with --shutdown-timeout 0.5 while a burst of ~3 s requests runs: each
                     gets a 503 with Retry-After or an error event, the exit is on time (its own ledger line,
                     "proxy exit"), and a new proxy takes the next bursts
  worker_kill        kill -9 one worker of `--workers 2` mid-burst (the supervisor starts it again)
  together           all of the above in one burst, staggered

    python bench/chaos.py                          # every fault, then together (simulator, ~2 min)
    python bench/chaos.py --quick                  # a few faults, tiny bursts (tests/test_chaos.py)
    python bench/chaos.py --md-out t.md --json-out t.json
    # the GPU host: the rhythm alone on real SGLang (its own 5 s keep-alive), 24 x 256 chat requests:
    python bench/chaos.py --sglang http://127.0.0.1:30000 --rhythm --rounds 24 --burst 256 --gaps 4.5 6

Traffic goes to 127.0.0.1 only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_proxy import free_port
from cpu_groups import children

ROOT = Path(__file__).resolve().parents[1]
IDS, ABORTED, ERROR, LOST, LEFT, CUT = "ids", "aborted", "error", "lost", "left", "cut"
OUTCOMES = (IDS, ABORTED, ERROR, LOST, LEFT, CUT)
CUT_WINDOW_S = 2.0
REQUEST_LIMIT_S = 60.0  # a request unanswered this long is lost
# SGLang's own failures the proxy passes on (its 500 is the proxy's own: never actionable).
SGLANG_STATUSES = (502, 503, 504)


# ---------------------------------------------------------------- classification (pure)

def error_message(body: bytes) -> str | None:
    """OpenAI's {"error": {"message"}} (or a bare "message"), else None."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    message = error.get("message") if isinstance(error, dict) else error if isinstance(error, str) else None
    message = message or data.get("message")
    return message if isinstance(message, str) and message.strip() else None


def _error_code(body: bytes):
    """OpenAI's error.code (vLLM's and the proxy's: the HTTP status, an integer), or None."""
    with contextlib.suppress(orjson.JSONDecodeError):
        data = orjson.loads(body)
        error = data.get("error") if isinstance(data, dict) else None
        return error.get("code") if isinstance(error, dict) else None
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Expect:
    """What a chat request asks for: `n` samples of `max_tokens` ids (exactly, with ignore_eos)."""

    max_tokens: int
    ignore_eos: bool = True
    n: int = 1


def classify_error(status: int, headers, body: bytes, admin: bool = False) -> tuple[str, str]:
    """A non-200 answer -> (ERROR or LOST, why). The requests are valid: a 4xx is the proxy's refusal,
    actionable only as a 429 with Retry-After or, to an admin call, a 409 naming what to do first."""
    message = error_message(body)
    if message is None:
        return LOST, f"{status} without an error message"
    code = _error_code(body)
    if code is not None and not _is_int(code):
        return LOST, f"{status} with a non-integer error code {code!r}: {message[:60]}"
    note = f"{status}: {message[:90]}"
    if status in (429, 503) and "Retry-After" not in headers:
        return LOST, f"{status} without Retry-After: {message[:70]}"
    if status in SGLANG_STATUSES or status == 429 or (admin and status == 409):
        return ERROR, note
    return LOST, note


def classify_samples(samples: dict[int, tuple[int, str | None]], expect: Expect,
                     abort_ok: bool) -> tuple[str, str]:
    """Each sample's (ids, finish_reason), by choice index, against its request: IDS when every sample is
    as asked, ABORTED when some ended "abort" during an aborting admin call (the rest as asked), else LOST."""
    if sorted(samples) != list(range(expect.n)):
        return LOST, f"{len(samples)} of {expect.n} samples"
    aborted = 0
    for ids, finish in samples.values():
        if finish == "abort":
            if not abort_ok:
                return LOST, f"finish_reason abort ({ids} ids) with no aborting admin call"
            aborted += 1
        elif not ((finish == "length" and ids == expect.max_tokens)
                  or (finish == "stop" and not expect.ignore_eos and ids <= expect.max_tokens)):
            return LOST, f"{ids} of {expect.max_tokens} ids with finish_reason {finish}"
    return (ABORTED, f"{aborted} of {expect.n} samples aborted") if aborted else (IDS, "")


def whole_samples(reply) -> dict[int, tuple[int, str | None]] | None:
    """A chat or completion reply's samples: index -> (ids, finish_reason); None: no list of choices."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        return None
    return {c.get("index", k): (len(c.get("token_ids") or ()), c.get("finish_reason"))
            for k, c in enumerate(choices)}


def classify_whole(status: int, headers, body: bytes, expect: Expect, abort_ok: bool = False) -> tuple[str, str]:
    if status != 200:
        return classify_error(status, headers, body)
    try:
        reply = orjson.loads(body)
    except orjson.JSONDecodeError:
        return LOST, "200 with a body that is not JSON"
    samples = whole_samples(reply)
    return (LOST, "200 without choices") if samples is None else classify_samples(samples, expect, abort_ok)


def classify_stream(status: int, headers, body: bytes, expect: Expect, abort_ok: bool = False) -> tuple[str, str]:
    """An SSE answer: every sample's ids and finish reason, then [DONE]; or an in-stream error event that
    names the failure."""
    if status != 200:
        return classify_error(status, headers, body)
    samples: dict[int, tuple[int, str | None]] = {}
    done = False
    for frame in body.split(b"\n\n"):
        frame = frame.strip()
        if not frame.startswith(b"data:"):
            continue
        data = frame[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return LOST, "a stream event that is not JSON"
        if isinstance(event, dict) and "error" in event:
            error = event["error"] if isinstance(event["error"], dict) else {}
            code, message = error.get("code"), error.get("message")
            if not message:
                return LOST, "a stream error event without a message"
            if not _is_int(code):
                return LOST, f"stream error with a non-integer code {code!r}: {message[:60]}"
            if code >= 500 and code not in SGLANG_STATUSES:
                return LOST, f"stream error {code}: {message[:80]}"
            return ERROR, f"stream error {code}: {message[:80]}"
        for choice in event.get("choices") or () if isinstance(event, dict) else ():
            ids, finish = samples.get(choice.get("index", 0), (0, None))
            samples[choice.get("index", 0)] = (ids + len(choice.get("token_ids") or ()),
                                               choice.get("finish_reason") or finish)
    if not done:
        return LOST, "stream ended without [DONE]"
    return classify_samples(samples, expect, abort_ok)


def query_params(path: str) -> dict[str, str]:
    query = path.partition("?")[2]
    return {name: value for name, _, value in (item.partition("=") for item in query.split("&") if item)}


def aborts_by_design(path: str, body=None) -> bool:
    """An admin call whose API ends the requests in flight (finish_reason "abort"): vLLM's /sleep (mode
    abort, its default), /pause?mode=abort, prime-rl's /pause {"mode": "abort"} (its mode is in the body; a
    bare /pause keeps them) and /abort_requests."""
    route, query = path.partition("?")[0], query_params(path)
    mode = query.get("mode")
    if route == "/pause" and mode is None and "clear_cache" not in query and isinstance(body, dict):
        mode = body.get("mode")  # prime-rl's dialect (admin/vllm_rl.py: the query names vLLM's)
    return (route == "/abort_requests" or (route == "/sleep" and mode in (None, "abort"))
            or (route == "/pause" and mode == "abort"))


# The admin calls the faults make, each with the body its API documents for a success (vLLM's, prime-rl's,
# SGLang's): (query, sent body, reply) -> what is wrong, or None.
def _sleep_reply(query: dict, sent, reply: dict) -> str | None:
    level = int(query.get("level", 1))
    return None if reply == {"status": "sleeping", "level": level} else f"not {{status: sleeping, level: {level}}}"


def _version_reply(query: dict, sent, reply: dict) -> str | None:
    wanted = (sent or {}).get("new_version")
    if reply.get("success") is True and reply.get("new_version") == wanted:
        return None
    return f"not {{success: true, new_version: {wanted}}}"


def _weights_reply(query: dict, sent, reply: dict) -> str | None:
    ok = reply.get("status") == "ok" and isinstance(reply.get("weight_version"), str)
    return None if ok else "not {status: ok, weight_version}"


def _status_reply(status: str):
    return lambda query, sent, reply: None if reply.get("status") == status else f"not {{status: {status}}}"


ADMIN_REPLIES = {
    "/sleep": _sleep_reply,  # vLLM
    "/wake_up": _status_reply("awake"),  # vLLM, no tags: every tag back
    "/pause": _status_reply("paused"),  # vLLM and prime-rl
    "/resume": _status_reply("resumed"),
    "/update_weight_version": _version_reply,  # SGLang's, passed through
    "/update_weights": _weights_reply,  # prime-rl's, with weight_dir
}


def classify_admin(path: str, sent, status: int, headers, body: bytes) -> tuple[str, str]:
    """An admin call's answer: IDS for a 200 with its documented body, else ERROR or LOST as any answer."""
    if status != 200:
        return classify_error(status, headers, body, admin=True)
    route = path.partition("?")[0]
    try:
        reply = orjson.loads(body)
    except orjson.JSONDecodeError:
        return LOST, f"{route}: 200 with a body that is not JSON"
    check = ADMIN_REPLIES.get(route)
    if check is None:
        return LOST, f"{route}: no documented reply to check"
    wrong = check(query_params(path), sent, reply) if isinstance(reply, dict) else "not a JSON object"
    return (IDS, "") if wrong is None else (LOST, f"{route}: 200 {wrong}: {body[:60].decode(errors='replace')}")


def classify_failure(exc: BaseException, at: float, kills: list[float]) -> tuple[str, str]:
    """No HTTP answer: cut when a proxy worker was killed just before, else lost."""
    what = "no answer within the client's limit" if isinstance(exc, asyncio.TimeoutError) else \
        f"{type(exc).__name__}: {str(exc)[:70]}"
    if any(kill - 0.05 <= at <= kill + CUT_WINDOW_S for kill in kills):
        return CUT, what
    return LOST, what


# ---------------------------------------------------------------- the ledger

@dataclass
class Entry:
    kind: str
    outcome: str
    note: str = ""


@dataclass
class Ledger:
    name: str
    entries: list[Entry] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)  # loop times of proxy-worker kills
    # [sent, answered] loop times of admin calls that abort requests by design (answered None: in flight)
    aborting: list[list] = field(default_factory=list)
    retries: float | None = None  # token_proxy_upstream_retries_total at the end (all reasons)

    def add(self, kind: str, outcome: str, note: str = "") -> None:
        self.entries.append(Entry(kind, outcome, note))

    def abort_ok(self, start: float, end: float) -> bool:
        """A request that ran over [start, end] met an aborting admin call."""
        return any(sent <= end and (answered is None or answered >= start) for sent, answered in self.aborting)

    def counts(self) -> dict[str, int]:
        found = Counter(entry.outcome for entry in self.entries)
        return {"sent": len(self.entries), **{outcome: found.get(outcome, 0) for outcome in OUTCOMES}}

    def notes(self, outcome: str, top: int = 3) -> list[tuple[str, int]]:
        return Counter(e.note for e in self.entries if e.outcome == outcome).most_common(top)

    def summary(self) -> dict:
        return {"fault": self.name, **self.counts(), "upstream_retries": self.retries,
                "errors": self.notes(ERROR), "aborted_why": self.notes(ABORTED), "lost_why": self.notes(LOST, 10)}


def table(ledgers: list[Ledger]) -> str:
    lines = [("| fault | sent | ids (strict) | aborted by admin | actionable error | lost | client left | "
              "cut (killed worker) | upstream retries | what the errors said |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for ledger in ledgers:
        c = ledger.counts()
        said = "; ".join(f"{n}x {note}" for note, n in ledger.notes(ERROR, 2)) or "-"
        lost = "; ".join(f"{n}x {note}" for note, n in ledger.notes(LOST, 2))
        retries = "-" if ledger.retries is None else f"{ledger.retries:g}"
        lines.append(f"| {ledger.name} | {c['sent']} | {c[IDS]} | {c[ABORTED]} | {c[ERROR]} | {c[LOST]}"
                     f"{' (' + lost + ')' if lost else ''} | {c[LEFT]} | {c[CUT]} | {retries} | {said} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- processes

def wait_healthy(url: str, proc: subprocess.Popen | None, limit_s: float, path: str = "/health") -> None:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{proc.args[:4]} exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url + path, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer {path} within {limit_s:.0f} s")


@dataclass
class Env:
    """The simulator (or a real SGLang URL) and one proxy in front of it."""

    args: argparse.Namespace
    log_dir: Path
    sim_port: int = 0
    sim: subprocess.Popen | None = None
    proxy: subprocess.Popen | None = None
    proxy_url: str = ""
    workers: int = 1
    keepalive: float = 0.0
    shutdown_timeout: float | None = None  # the proxy's --shutdown-timeout, when not its default
    weights: Path | None = None
    version: int = 0

    @property
    def backend(self) -> str:
        return self.args.sglang or f"http://127.0.0.1:{self.sim_port}"

    def start_sim(self) -> None:
        if self.args.sglang:
            return
        self.sim_port = self.sim_port or free_port()
        cmd = [sys.executable, "-m", "token_proxy.simulator", "--host", "127.0.0.1", "--port", str(self.sim_port),
               "--ttft-ms", "20", "--tpot-ms", str(self.args.tpot_ms), "--incremental-streaming-output",
               "--enable-memory-saver", "--enable-weights-cpu-backup", "--log-level", "warning",
               "--timeout-keep-alive", str(self.args.sim_keep_alive), "--keep-alive-late", str(self.args.sim_late)]
        with open(self.log_dir / "sim.log", "ab") as log:
            self.sim = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=_env())

    def start_proxy(self, workers: int, keepalive: float, shutdown_timeout: float | None = None) -> None:
        self.stop_proxy()
        self.workers, self.keepalive, self.shutdown_timeout, port = workers, keepalive, shutdown_timeout, free_port()
        self.proxy_url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "token_proxy", "--host", "127.0.0.1", "--port", str(port),
               "--backend", self.backend, "--workers", str(workers), "--log-level", "warning",
               "--backend-keepalive", str(keepalive)]
        if shutdown_timeout is not None:
            cmd += ["--shutdown-timeout", str(shutdown_timeout)]
        with open(self.log_dir / f"proxy-{port}.log", "ab") as log:
            self.proxy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=_env())
        wait_healthy(self.proxy_url, self.proxy, 120, "/v1/models")

    def stop_proxy(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            try:
                self.proxy.wait(30)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait()
        self.proxy = None

    def stop(self) -> None:
        self.stop_proxy()
        if self.sim is not None and self.sim.poll() is None:
            self.sim.kill()
            self.sim.wait()

    def weight_dir(self) -> str:
        self.version += 1
        directory = self.log_dir / "weights" / f"step_{self.version}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "model.safetensors").write_bytes(b"\0")
        return str(directory)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


# ---------------------------------------------------------------- traffic

def chat_body(i: int, max_tokens: int, stream: bool) -> dict:
    body = {"messages": [{"role": "user", "content": f"Rollout {i}: say something."}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 1.0, "return_token_ids": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def one_request(session: aiohttp.ClientSession, env: Env, ledger: Ledger, i: int, max_tokens: int,
                      stream: bool, leave: bool) -> None:
    kind = "chat-stream" if stream else "chat"
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with asyncio.timeout(REQUEST_LIMIT_S), session.post(
                env.proxy_url + "/v1/chat/completions", json=chat_body(i, max_tokens, stream)) as resp:
            if leave and resp.status == 200:
                await resp.content.readany()  # the first chunk, then the client goes away
                resp.close()
                ledger.add(kind, LEFT)
                return
            body = await resp.read()
            outcome, note = (classify_stream if stream else classify_whole)(
                resp.status, resp.headers, body, Expect(max_tokens), ledger.abort_ok(start, loop.time()))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        outcome, note = classify_failure(exc, loop.time(), ledger.kills)
    ledger.add(kind, outcome, note)


async def admin(session: aiohttp.ClientSession, env: Env, ledger: Ledger, method: str, path: str,
                body: dict | None = None) -> int:
    """An admin call, ledgered like any request: 200 with its documented body, or an actionable error.
    One that aborts requests by design opens a window in which aborted samples are its doing."""
    loop = asyncio.get_running_loop()
    window = [loop.time(), None]
    if aborts_by_design(path, body):
        ledger.aborting.append(window)
    try:
        async with asyncio.timeout(REQUEST_LIMIT_S), session.request(method, env.proxy_url + path,
                                                                      json=body) as resp:
            raw = await resp.read()
            outcome, note = classify_admin(path, body, resp.status, resp.headers, raw)
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        outcome, note = classify_failure(exc, loop.time(), ledger.kills)
        status = 0
    window[1] = loop.time()
    ledger.add(f"admin {path.split('?')[0]}", outcome, note)
    return status if outcome == IDS else 0


async def burst(session, env: Env, ledger: Ledger, size: int, max_tokens: int, leave_every: int,
                counter: list[int], streams: bool = True) -> None:
    """`size` requests at once: every other one streamed (with `streams`); with leave_every, every
    n-th stream leaves."""
    calls = []
    for k in range(size):
        counter[0] += 1
        stream = streams and k % 2 == 1
        leave = bool(leave_every) and stream and (k // 2) % leave_every == 0
        calls.append(one_request(session, env, ledger, counter[0], max_tokens, stream, leave))
    await asyncio.gather(*calls)


# ---------------------------------------------------------------- faults

async def fault_sglang_kill(session, env: Env, ledger: Ledger) -> None:
    if env.sim is None:
        return
    env.sim.send_signal(signal.SIGKILL)
    await asyncio.to_thread(env.sim.wait)
    await asyncio.sleep(0.3)
    env.start_sim()  # same port; the proxy answers 503 + Retry-After until it listens again


async def fault_weights_primerl(session, env: Env, ledger: Ledger) -> None:
    await admin(session, env, ledger, "POST", "/update_weights", {"weight_dir": env.weight_dir()})


async def fault_weights_vllm(session, env: Env, ledger: Ledger) -> None:
    env.version += 1
    if await admin(session, env, ledger, "POST", "/pause?mode=keep&clear_cache=false") == 200:
        await admin(session, env, ledger, "POST", "/update_weight_version", {"new_version": f"v{env.version}"})
    await admin(session, env, ledger, "POST", "/resume")


async def fault_sleep_wake(session, env: Env, ledger: Ledger) -> None:
    await admin(session, env, ledger, "POST", "/sleep?level=1")
    await asyncio.sleep(0.3)
    await admin(session, env, ledger, "POST", "/wake_up")


async def fault_worker_kill(session, env: Env, ledger: Ledger) -> None:
    if env.proxy is None or env.workers < 2:
        return
    worker = next((pid for pid, cmd in children(env.proxy.pid).items()
                   if "token_proxy.serving.process" in cmd and cmd.split()[-1] == "1"), None)
    if worker is not None:
        ledger.kills.append(asyncio.get_running_loop().time())
        os.kill(worker, signal.SIGKILL)


async def fault_sigterm(session, env: Env, ledger: Ledger) -> None:
    """SIGTERM past --shutdown-timeout: the requests in flight are the ledger's (503 + Retry-After, or an
    error event: actionable); the exit itself is one line, on time within the timeout + 1 s or lost."""
    if env.proxy is None or env.shutdown_timeout is None:
        return
    sent = time.monotonic()
    env.proxy.send_signal(signal.SIGTERM)
    try:
        code = await asyncio.to_thread(env.proxy.wait, env.shutdown_timeout + 10)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - sent
    on_time = code == 0 and took <= env.shutdown_timeout + 1.0
    ledger.add("proxy exit", IDS if on_time else LOST, f"exit {code} after {took:.1f} s "
               f"(--shutdown-timeout {env.shutdown_timeout:g})")
    env.proxy = None
    await asyncio.to_thread(env.start_proxy, env.workers, env.keepalive, env.shutdown_timeout)


FAULTS = {"sglang_kill": fault_sglang_kill, "sigterm": fault_sigterm, "weights_primerl": fault_weights_primerl,
          "weights_vllm": fault_weights_vllm, "sleep_wake": fault_sleep_wake, "worker_kill": fault_worker_kill}


@dataclass(frozen=True)
class Scenario:
    name: str
    faults: tuple[str, ...] = ()
    leave_every: int = 0  # client_disconnect: every n-th stream leaves
    workers: int = 1
    backend_keepalive: float | None = None  # the proxy's --backend-keepalive, when not the run's
    shutdown_timeout: float | None = None  # the proxy's --shutdown-timeout, when not its default
    fault_tokens: int = 1  # the fault round's max_tokens, times the run's


SCENARIOS = (
    Scenario("keepalive"),
    # The pool outliving SGLang's keep-alive (as before --backend-keepalive: 60 s against 5 s): the retry's work.
    Scenario("keepalive_pool_30s", backend_keepalive=30.0),
    Scenario("sglang_kill", ("sglang_kill",)),
    Scenario("weights_primerl", ("weights_primerl",)),
    Scenario("weights_vllm", ("weights_vllm",)),
    Scenario("sleep_wake", ("sleep_wake",)),
    Scenario("client_disconnect", leave_every=3),
    Scenario("worker_kill", ("worker_kill",), workers=2),
    # ~3 s requests (160 tokens at 20 ms) past a 0.5 s deadline: every one is cut by the drain
    Scenario("sigterm_deadline", ("sigterm",), shutdown_timeout=0.5, fault_tokens=10),
    Scenario("together", ("weights_primerl", "weights_vllm", "sleep_wake", "worker_kill", "sglang_kill"),
             leave_every=3, workers=2),
)
QUICK = ("keepalive_pool_30s", "weights_primerl", "client_disconnect", "sglang_kill")


async def upstream_retries(session, env: Env) -> float | None:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
        async with asyncio.timeout(10), session.get(env.proxy_url + "/metrics") as resp:
            text = await resp.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("token_proxy_upstream_retries_total{"))
    return None


async def run_scenario(env: Env, scenario: Scenario, args) -> Ledger:
    ledger = Ledger(scenario.name)
    counter = [0]
    gaps = args.gaps_list
    fault_round = args.rounds // 2
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        before = await upstream_retries(session, env)
        for r in range(args.rounds):
            tokens = args.max_tokens * (3 if scenario.name == "together" and r == fault_round else 1)
            tokens *= scenario.fault_tokens if r == fault_round else 1
            work = [burst(session, env, ledger, args.burst, tokens, scenario.leave_every, counter,
                          streams=not args.rhythm)]
            if r == fault_round:
                for k, name in enumerate(scenario.faults):
                    work.append(_later(args.fault_at + k * args.stagger, FAULTS[name](session, env, ledger)))
            await asyncio.gather(*work)
            if r < args.rounds - 1:
                await asyncio.sleep(gaps[r % len(gaps)])
        after = await upstream_retries(session, env)
    if before is not None and after is not None:
        ledger.retries = after - before
    return ledger


async def _later(delay: float, coro) -> None:
    await asyncio.sleep(delay)
    await coro


def _recover(env: Env, undo: bool) -> None:
    """Between scenarios: SGLang up, every fault undone (awake, resumed: `undo`), the proxy serving."""
    if env.sim is not None and env.sim.poll() is not None:
        env.start_sim()
    wait_healthy(env.backend, env.sim, 120)
    for path in ("/wake_up", "/resume") if undo else ():
        with contextlib.suppress(OSError):
            urllib.request.urlopen(urllib.request.Request(env.proxy_url + path, data=b"", method="POST"), timeout=30)
    wait_healthy(env.proxy_url, env.proxy, 60, "/v1/models")


def run(args) -> list[Ledger]:
    log_dir = Path(tempfile.mkdtemp(prefix="chaos-"))
    env = Env(args, log_dir)
    if args.rhythm:
        scenarios = [Scenario("rhythm")]
    else:
        names = args.faults or (QUICK if args.quick else [s.name for s in SCENARIOS])
        scenarios = [s for s in SCENARIOS if s.name in names]
    ledgers = []
    started = time.monotonic()
    try:
        env.start_sim()
        wait_healthy(env.backend, env.sim, 180)
        for scenario in scenarios:
            keepalive = scenario.backend_keepalive or args.backend_keepalive
            wanted = (scenario.workers, keepalive, scenario.shutdown_timeout)
            if env.proxy is None or (env.workers, env.keepalive, env.shutdown_timeout) != wanted:
                env.start_proxy(*wanted)
            _recover(env, undo=not args.rhythm)
            ledger = asyncio.run(run_scenario(env, scenario, args))
            ledgers.append(ledger)
            c = ledger.counts()
            print(f"[{time.monotonic() - started:5.0f}s] {scenario.name}: sent {c['sent']}, ids {c[IDS]}, "
                  f"aborted {c[ABORTED]}, error {c[ERROR]}, lost {c[LOST]}, left {c[LEFT]}, cut {c[CUT]}", file=sys.stderr, flush=True)
    finally:
        env.stop()
    print(f"logs: {log_dir}", file=sys.stderr)
    return ledgers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sglang", help="a live SGLang URL (127.0.0.1) instead of the simulator")
    p.add_argument("--rhythm", action="store_true", help=("bursts of non-streaming chats and gaps only, no "
                   "injected faults (SGLang's own keep-alive closes are the fault)"))
    p.add_argument("--quick", action="store_true", help=f"faults {', '.join(QUICK)}; 2 rounds of 6")
    p.add_argument("--faults", nargs="+", choices=[s.name for s in SCENARIOS], help="only these")
    p.add_argument("--rounds", type=int, default=4, help="bursts per fault (the fault hits the middle one)")
    p.add_argument("--burst", type=int, default=24, help="requests sent at once per burst (half streamed)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--gaps", type=float, nargs="+", default=None,
                   help="idle gaps, seconds: a list swept in turn; with --rhythm, MIN MAX spread over the rounds "
                        "(default: around the simulator's keep-alive)")
    p.add_argument("--fault-at", type=float, default=0.1, help="seconds into the burst the fault starts")
    p.add_argument("--stagger", type=float, default=0.25, help="seconds between the faults of `together`")
    p.add_argument("--tpot-ms", type=float, default=20.0, help="the simulator's time per output token")
    p.add_argument("--sim-keep-alive", type=float, default=1.0, help="the simulator's SGLANG_TIMEOUT_KEEP_ALIVE")
    p.add_argument("--sim-late", type=float, default=0.5, help="how late its keep-alive close may run")
    p.add_argument("--backend-keepalive", type=float, default=None,
                   help="the proxy's --backend-keepalive (default: 0.8 x the simulator's; 4 on real SGLang)")
    p.add_argument("--json-out")
    p.add_argument("--md-out")
    args = p.parse_args(argv)
    if args.sglang and not args.sglang.startswith(("http://127.0.0.1", "http://localhost")):
        p.error("--sglang must be a loopback URL (http://127.0.0.1:PORT): traffic stays on this host")
    if args.quick:
        args.rounds, args.burst = min(args.rounds, 2), min(args.burst, 6)
    if not 1 <= args.rounds <= 200 or not 1 <= args.burst <= 4096:
        p.error("--rounds must be in 1..200 and --burst in 1..4096")
    if args.backend_keepalive is None:
        args.backend_keepalive = 4.0 if args.sglang else round(args.sim_keep_alive * 0.8, 3)
    k = args.sim_keep_alive
    gaps = args.gaps or ([4.5, 6.0] if args.sglang else [k + 0.2] if args.quick else [k - 0.1, k + 0.1, k + 0.3])
    if args.rhythm and len(gaps) == 2 and args.rounds > 1:  # MIN MAX: a sweep across the rounds
        lo, hi = gaps
        gaps = [lo + (hi - lo) * r / (args.rounds - 2 or 1) for r in range(args.rounds - 1)]
    if any(not 0 <= gap <= 60 for gap in gaps):
        p.error("every gap must be in 0..60 s")
    args.gaps_list = gaps
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    ledgers = run(args)
    text = table(ledgers)
    print(text)
    wall = time.monotonic() - started
    print(f"\nwall time {wall:.0f} s; lost in all: {sum(ledger.counts()[LOST] for ledger in ledgers)}")
    if args.md_out:
        Path(args.md_out).write_text(text + "\n")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"wall_s": round(wall, 1), "gaps_s": args.gaps_list,
                                                   "faults": [ledger.summary() for ledger in ledgers]}, indent=1))
    return 1 if any(ledger.counts()[LOST] for ledger in ledgers) else 0


if __name__ == "__main__":
    sys.exit(main())
