"""The weight bridge on a live SGLang (issue 38): the CUDA-IPC hand-off on one GPU, and with a GPU for the trainer
(E2E_TRAINER_GPU, else skipped) the trainer's pushes in both dialects through the proxy and the bridge, under
rollouts, with NCCL's default transports and with sockets only (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, standing
in for a trainer on another node); then the failure drills. tests/e2e/bridge_sender.py says what the trainer is.

Exactness: SGLang 0.5.17 has no get_weights_by_name for Qwen2, so values are checked by SGLang's own checksum of
every parameter (/weights_checker through the proxy's /weight_checker) and by greedy ids + logprobs, each on an
empty prefix cache (test_live_weights.fresh_greedy says why)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.test_live_weights import free_port, fresh_greedy, logprobs_of, post, stream

TRAINER_GPU = os.environ.get("E2E_TRAINER_GPU")
SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
needs_two = pytest.mark.skipif(not TRAINER_GPU, reason="set E2E_TRAINER_GPU to a GPU other than SGLang's")


@pytest.fixture
async def model_path(sglang):
    _, info = await sglang.get("/model_info")
    return info["model_path"]


async def checksum(proxy) -> dict:
    status, body = await post(proxy, "/weight_checker", {"action": "checksum"})
    assert status == 200, body
    return body["checksums"]


HANDOFF = textwrap.dedent('''
    import asyncio, sys, aiohttp, torch
    from safetensors.torch import load_file
    from token_proxy.bridge import handoff, sglang_load
    from token_proxy.bridge.wire import Bucket, Slot
    url, model_dir, mode = sys.argv[1:4]
    tensors = load_file(f"{model_dir}/model.safetensors", device="cuda")
    if mode == "perturb":
        g = torch.Generator(device="cuda").manual_seed(1)
        tensors = {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g, device="cuda")).to(v.dtype)
                   for k, v in tensors.items()}
    # one uint8 buffer holding every tensor, as a vLLM packed chunk arrives
    parts = [t.contiguous().view(-1).view(torch.uint8) for t in tensors.values()]
    slots, offset = [], 0
    for (name, t), part in zip(tensors.items(), parts):
        slots.append(Slot(name, str(t.dtype).split(".")[-1], tuple(t.shape), 0, offset, offset + part.numel()))
        offset += part.numel()
    bucket = Bucket([torch.cat(parts)], ["uint8"], slots)
    payload = handoff.ipc_payload(handoff.named_views(bucket), handoff.gpu_uuid(0))
    async def main():
        async with aiohttp.ClientSession() as s:
            return await sglang_load.load_bucket(s, url, [payload], 120)
    ok, message = asyncio.run(main())
    del bucket
    torch.cuda.ipc_collect()
    print("OK" if ok else "REFUSED", message, offset)
''')


def run_handoff(url: str, model_path: str, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HANDOFF, url, model_path, mode], capture_output=True, text=True,
                          timeout=180, check=False)


def receivers(pid: int) -> list[int]:
    """The bridge's receiver processes: its children started by multiprocessing's spawn (not its resource tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(int(stat.parent.name))
    return found


async def test_ipc_handoff_one_gpu(proxy, sglang, model_path):
    """The bridge's hand-off (handoff.py) into real SGLang: every tensor as a view of one received buffer, through
    /update_weights_from_tensor with the GPU's UUID; perturbed, then the checkpoint's own values: exact again."""
    before, sums = await fresh_greedy(proxy), await checksum(proxy)
    for mode in ("perturb", "restore"):
        t0 = time.perf_counter()
        out = await asyncio.get_running_loop().run_in_executor(None, run_handoff, sglang.url, model_path, mode)
        print(f"handoff {mode}: {time.perf_counter() - t0:.2f} s: {out.stdout.strip()[-200:]}")
        assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr[-2000:]
        if mode == "perturb":
            assert await checksum(proxy) != sums
            assert logprobs_of(await fresh_greedy(proxy)) != logprobs_of(before)
    assert await checksum(proxy) == sums  # every parameter exact
    restored = await fresh_greedy(proxy)
    assert (restored["token_ids"], logprobs_of(restored)) == (before["token_ids"], logprobs_of(before))


class Bridge:
    def __init__(self, sglang_url: str, env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "token_proxy.bridge", "--sglang", sglang_url, "--port", str(self.port)]
        for key, value in env.items():
            args += ["--nccl-env", f"{key}={value}"]
        self.log = open(f"/tmp/bridge-{self.port}.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(120):
            try:
                with urllib.request.urlopen(f"{self.url}/bridge/info", timeout=2) as r:
                    self.info = json.load(r)
                    return
            except OSError:
                assert self.proc.poll() is None, Path(self.log.name).read_text()[-2000:]
                time.sleep(0.5)
        raise AssertionError("the bridge did not start")

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        return Path(self.log.name).read_text()


def sender(dialect: str, proxy_url: str, model_dir: str, steps_dir: str, env: dict, packed: int = 0,
           steps: int = 2, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    full = {**os.environ, **env, "CUDA_VISIBLE_DEVICES": TRAINER_GPU, "NCCL_NVLS_ENABLE": "0"}
    full.pop("NCCL_CUMEM_ENABLE", None)  # a stock trainer: NCCL's default
    args = [sys.executable, "tests/e2e/bridge_sender.py", dialect, proxy_url, str(free_port()), model_dir, steps_dir,
            "--packed-bytes", str(packed), "--steps", str(steps), *extra]
    return subprocess.Popen(args, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def wait_line(proc: subprocess.Popen, key: str, timeout_s: float = 300, also: str | None = None) -> dict:
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = await asyncio.wait_for(loop.run_in_executor(None, proc.stdout.readline), deadline - time.monotonic())
        if not line:
            raise AssertionError(f"the trainer exited ({proc.wait()}) before {key}")
        try:
            doc = json.loads(line) if line.startswith("{") else None
        except ValueError:  # a log line that happens to start with a brace (vLLM's logger writes to stdout)
            doc = None
        if isinstance(doc, dict) and (key in doc or (also is not None and also in doc)):
            return doc
        print("trainer:", line.rstrip())
    raise AssertionError(f"no {key} from the trainer within {timeout_s} s")


ENGINE_SRC = os.environ.get("VLLM_ENGINE_SRC", "")
ENGINE = Path(ENGINE_SRC, "vllm/distributed/weight_transfer/nccl_engine.py")


@needs_two
@pytest.mark.parametrize("transport", ["default", "sockets"])
@pytest.mark.parametrize(("dialect", "packed"), [("primerl", 0), ("vllm", 1 << 20), ("vllm", 0),
                                                 ("vllm-engine", 1 << 20), ("vllm-engine", 0)])
async def test_trainer_pushes_through_the_bridge(live_proxy, sglang, model_path, tmp_path, dialect, packed, transport):
    """primerl and vllm: tests/e2e/bridge_sender.py's trainer (upstream framing, our group opening); vllm-engine:
    vLLM 0.33's own NCCLTrainerWeightTransferEngine, unmodified, from VLLM_ENGINE_SRC (skipped without it)."""
    if dialect == "vllm-engine" and not ENGINE.is_file():
        pytest.skip(f"VLLM_ENGINE_SRC={ENGINE_SRC!r} holds no vLLM 0.33 source (.gpu/vllm033py.tar.xz)")
    env = SOCKETS if transport == "sockets" else {}
    bridge = Bridge(sglang.url, env)
    try:
        proxy = await live_proxy(weight_bridges=(bridge.url,), check_local_paths=False)
        url = str(proxy.make_url("")).rstrip("/")
        before, sums = await fresh_greedy(proxy), await checksum(proxy)
        _, info = await sglang.get("/model_info")
        unversioned = info["weight_version"]  # vLLM's engine finishes with no version: SGLang's stays
        trainer = sender(dialect, url, model_path, str(tmp_path), env, packed, extra=("--gated",))
        joined = await wait_line(trainer, "joined_s", also="engine_unusable")
        if "engine_unusable" in joined:  # vLLM's own engine cannot run on this host's NCCL: said, not hidden
            pytest.skip(joined["engine_unusable"])
        print(joined)
        for step in (1, 2):
            rollouts = [asyncio.ensure_future(stream(proxy, 200)) for _ in range(8)]
            await asyncio.sleep(0.2)
            if dialect == "primerl":  # the orchestrator's step, verbatim in order
                assert await post(proxy, "/pause") == (200, {"status": "paused"})
                (tmp_path / f"step_{step}").mkdir()
                (tmp_path / f"step_{step}" / "NCCL_READY").touch()
                status, reply = await post(proxy, "/update_weights", {"weight_dir": str(tmp_path / f"step_{step}")})
                assert (status, reply) == (200, {"status": "ok", "weight_version": str(step)}), reply
                assert await post(proxy, "/resume") == (200, {"status": "resumed"})
            else:  # the vLLM trainer pushes on its own, once cued (bridge_sender --gated)
                (tmp_path / f"step_{step}").mkdir()
                (tmp_path / f"step_{step}" / "NCCL_READY").touch()
            print(await wait_line(trainer, "step"))
            for chunks in await asyncio.gather(*rollouts):  # none lost
                ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
                assert len(ids) == 200
            version = {"primerl": str(step), "vllm": f"v{step}"}.get(dialect, unversioned)
            _, info = await sglang.get("/model_info")
            assert info["weight_version"] == version
            if step == 1:
                assert await checksum(proxy) != sums
        assert trainer.wait(60) == 0
        assert await checksum(proxy) == sums
        restored = await fresh_greedy(proxy)
        assert (restored["token_ids"], logprobs_of(restored)) == (before["token_ids"], logprobs_of(before))
    finally:
        print(bridge.stop()[-1500:])


@needs_two
async def test_mismatched_nccl_environment_is_one_clear_error(live_proxy, sglang, model_path, tmp_path):
    """The bridge told to run NCCL_CUMEM_ENABLE=0 against a trainer on NCCL's default (on): expected a clear
    error from the join (NCCL refuses mixed cuMem in its p2p setup) within the trainer's timeout, not a hang."""
    bridge = Bridge(sglang.url, {"NCCL_CUMEM_ENABLE": "0"})
    try:
        proxy = await live_proxy(weight_bridges=(bridge.url,), check_local_paths=False, init_group_timeout_s=60)
        url = str(proxy.make_url("")).rstrip("/")
        t0 = time.perf_counter()
        trainer = sender("vllm", url, model_path, str(tmp_path), {}, 0, steps=1)
        try:
            code = await asyncio.get_running_loop().run_in_executor(None, trainer.wait, 240)
        except subprocess.TimeoutExpired:
            code = None  # the trainer hung in NCCL: what the drill exists to show, if it happens
            trainer.kill()
        out = trainer.stdout.read()
        print(f"trainer exit {code} after {time.perf_counter() - t0:.1f} s: {out[-1500:]}")
        log = Path(bridge.log.name).read_text()
        assert "NCCL init with the trainer failed" in log or "did not answer" in log or code not in (0, None), log
        assert code is not None, "the trainer hung (the bridge reported; nothing ends a peer's collective)"
    finally:
        print(bridge.stop()[-3000:])


@needs_two
async def test_a_trainer_whose_pynccl_turned_itself_off_is_named_within_the_grace(live_proxy, sglang, model_path,
                                                                                    tmp_path):
    """vLLM 0.33's own engine on this host's NCCL as it is (no upstream.fit_vllm_nccl): where the library lacks
    ncclCommSuspend (NCCL < 2.29.7), vLLM's PyNcclCommunicator turns itself off without a word and publishes no id.
    Expected: the bridge names that in one line ~30 s after its rank joined the trainer's store (not after the
    300 s join timeout), and the trainer's trainer_init fails on the proxy's 502 instead of hanging."""
    if not ENGINE.is_file():
        pytest.skip(f"VLLM_ENGINE_SRC={ENGINE_SRC!r} holds no vLLM 0.33 source (.gpu/vllm033py.tar.xz)")
    bridge = Bridge(sglang.url, {})
    try:
        proxy = await live_proxy(weight_bridges=(bridge.url,), check_local_paths=False)
        url = str(proxy.make_url("")).rstrip("/")
        trainer = sender("vllm-engine", url, model_path, str(tmp_path), {}, 1 << 20, steps=1,
                         extra=("--keep-vllm-nccl",))
        state = await wait_line(trainer, "pynccl_off", also="pynccl_loads")
        if "pynccl_loads" in state:
            trainer.kill()
            pytest.skip(f"this host's NCCL has every symbol vLLM 0.33 binds ({state}): PyNccl stays on")
        t0 = time.perf_counter()
        code = await asyncio.get_running_loop().run_in_executor(None, trainer.wait, 120)
        elapsed = time.perf_counter() - t0
        out = trainer.stdout.read()
        print(f"trainer exit {code} after {elapsed:.1f} s: {out[-1500:]}")
        log = Path(bridge.log.name).read_text()
        assert "but the trainer published no NCCL id within 30 s: its PyNcclCommunicator turned itself off" in log
        assert code != 0 and "502" in out, out[-1500:]
        assert elapsed < 90, elapsed
    finally:
        print(bridge.stop()[-3000:])


async def primerl_step(proxy, steps_dir: Path, step: int) -> tuple[int, dict]:
    """The prime-rl orchestrator's step through the proxy: /pause, NCCL_READY, /update_weights (not /resume)."""
    print("pause:", await post(proxy, "/pause"))  # a second pause while held is SGLang's to answer; not the point
    (steps_dir / f"step_{step}").mkdir()
    (steps_dir / f"step_{step}" / "NCCL_READY").touch()
    return await post(proxy, "/update_weights", {"weight_dir": str(steps_dir / f"step_{step}")})


@needs_two
@pytest.mark.parametrize("bad", ["name", "shape"])
async def test_a_tensor_sglang_cannot_take_is_refused_drained_held_and_the_next_push_recovers(
        live_proxy, sglang, model_path, tmp_path, bad):
    """Step 1 sends model.layers.0.mlp.down_proj.weight misnamed (SGLang 0.5.17 would drop it with a warning) or
    flattened (its loader would assert and stop the server): the bridge refuses that bucket before SGLang sees it,
    drains the rest so the trainer's broadcasts complete, the proxy answers the orchestrator an error naming the
    worker and the reason and holds the fleet; step 2 (the checkpoint's own values) lands on the same group."""
    bridge = Bridge(sglang.url, {})
    try:
        proxy = await live_proxy(weight_bridges=(bridge.url,), check_local_paths=False)
        url = str(proxy.make_url("")).rstrip("/")
        before, sums = await fresh_greedy(proxy), await checksum(proxy)
        trainer = sender("primerl", url, model_path, str(tmp_path), {}, extra=("--bad-step", "1", "--bad", bad))
        await wait_line(trainer, "joined_s")
        status, reply = await primerl_step(proxy, tmp_path, 1)
        print(status, reply)
        message = reply["error"]["message"]
        assert status == 400, reply
        assert f"{sglang.url}: refused by the weight bridge" in message
        assert ("model.layers.0.mlp.down_prj.weight" if bad == "name" else "down_proj.weight has shape") in message
        assert (await wait_line(trainer, "step"))["step"] == 1  # the trainer's broadcasts completed: drained
        assert (await post(proxy, "/resume"))[0] == 409  # held
        assert (await sglang.get("/health"))[0] == 200
        status, reply = await primerl_step(proxy, tmp_path, 2)
        assert (status, reply) == (200, {"status": "ok", "weight_version": "2"}), reply
        assert await post(proxy, "/resume") == (200, {"status": "resumed"})
        assert (await wait_line(trainer, "step"))["step"] == 2
        assert trainer.wait(60) == 0
        assert await checksum(proxy) == sums
        restored = await fresh_greedy(proxy)
        assert (restored["token_ids"], logprobs_of(restored)) == (before["token_ids"], logprobs_of(before))
    finally:
        print(bridge.stop()[-2000:])


@needs_two
async def test_bridge_killed_mid_push(live_proxy, sglang, model_path, tmp_path):
    """The receiver killed between two chunks of one push (the trainer sleeps 3 s after each): the proxy answers the
    orchestrator 503 naming the dead rank and holds the fleet; the trainer is left in NCCL (nothing can end a peer's
    collective: killed here); the trainer's restart (a new init) and its next push recover, values exact."""
    bridge = Bridge(sglang.url, {})
    try:
        proxy = await live_proxy(weight_bridges=(bridge.url,), check_local_paths=False)
        url = str(proxy.make_url("")).rstrip("/")
        before, sums = await fresh_greedy(proxy), await checksum(proxy)
        trainer = sender("primerl", url, model_path, str(tmp_path), {}, steps=1, extra=("--pause-between-s", "3"))
        await wait_line(trainer, "joined_s")
        pushing = asyncio.ensure_future(primerl_step(proxy, tmp_path, 1))
        print(await wait_line(trainer, "chunk_sent", 60))  # the first chunk is out; the trainer sleeps 3 s
        await asyncio.sleep(1)  # its load into SGLang has ended; the receiver waits in the next chunk's receive
        killed = receivers(bridge.proc.pid)
        assert len(killed) == 1, killed
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        status, reply = await asyncio.wait_for(pushing, 120)
        print(status, reply)
        assert status == 503, reply
        assert "died" in reply["error"]["message"] or "did not answer" in reply["error"]["message"], reply
        assert (await post(proxy, "/resume"))[0] == 409  # held
        trainer.kill()
        trainer.wait(30)
        restart = sender("primerl", url, model_path, str(tmp_path / "restart"), {}, steps=2)
        (tmp_path / "restart").mkdir()
        await wait_line(restart, "joined_s")
        for step in (1, 2):  # perturbed, then the checkpoint's own values
            status, reply = await primerl_step(proxy, tmp_path / "restart", step)
            assert (status, reply) == (200, {"status": "ok", "weight_version": str(step)}), reply
            await wait_line(restart, "step")
        assert await post(proxy, "/resume") == (200, {"status": "resumed"})
        assert restart.wait(60) == 0
        assert await checksum(proxy) == sums
        restored = await fresh_greedy(proxy)
        assert (restored["token_ids"], logprobs_of(restored)) == (before["token_ids"], logprobs_of(before))
    finally:
        print(bridge.stop()[-2000:])
