"""The container image for real, on a Docker engine (marked `docker`; `make image-test` runs it).

deploy/Dockerfile is built unmodified and run with host networking on a free loopback port; Docker's own
HEALTHCHECK must turn it healthy; then /health, /metrics, a chat completion with token ids, the log
stream (every line JSON), the user the processes run as, and a clean `docker stop`. A Prometheus
container (Debian's package, tests/docker/prometheus.Dockerfile) runs deploy/prometheus.yml with its
targets pointed at the proxy and its built-in simulator, and every Grafana dashboard query is asked of
Prometheus's HTTP API. Skipped when no Docker engine answers or the base image cannot be had.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from tests.api.test_proxy_chat import CHOICE_KEYS, GOLDEN_PROMPT_IDS, TOP_KEYS, USER
from tests.serving.test_deploy import docker_run_recipes
from tests.support.admin_fixtures import free_port

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RUN_ID = uuid.uuid4().hex[:8]
# Kept after the run: their untagged build layers are the cache that makes the next run fast.
PROXY_IMAGE = "sglang-token-proxy:image-test"
PROMETHEUS_IMAGE = "token-proxy-prometheus:image-test"
SHUTDOWN_TIMEOUT_S = 10
# Queries with no data unless something went wrong (errors, disconnects, overload) or a weight update ran.
QUIET_QUERIES = ("token_proxy_backend_errors_total", "token_proxy_client_disconnects_total",
                 "token_proxy_overload_rejections_total", "token_proxy_weight_update",
                 "vllm:num_preemptions_total")


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def tail(result: subprocess.CompletedProcess, lines: int = 25) -> str:
    return "\n".join((result.stdout + result.stderr).splitlines()[-lines:])


@pytest.fixture(scope="module")
def engine() -> None:
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI on PATH (`make image-test` installs docker.io and starts dockerd)")
    info = docker("info", "--format", "{{.ServerVersion}}", timeout=30)
    if info.returncode:
        pytest.skip(f"no Docker engine answers: {tail(info, 1)} (`make image-test` starts one)")
    for base in sorted(set(re.findall(r"^FROM\s+(\S+)", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE))):
        if docker("image", "inspect", base).returncode:
            pytest.skip(f"base image {base} is neither present nor pullable here (`make image-test` builds a "
                        "stand-in from Debian packages with ../shared/docker/make_base_image.sh)")


def build_context() -> bytes:
    """The repository's files as a tar (what a clone holds, working-tree edits included): Docker's legacy
    builder ignores deploy/Dockerfile.dockerignore and would otherwise send .venv and .git as context."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=False, cwd=ROOT, capture_output=True)
    names = listed.stdout.decode().split("\0") if listed.returncode == 0 else None
    skip = {".git", ".venv", "__pycache__"}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:  # gzip: the CLI sniffs it
        if names is None:
            tar.add(ROOT, arcname=".", filter=lambda info: None if skip & set(Path(info.name).parts) else info)
        for name in names or ():
            if name and (ROOT / name).is_file():
                tar.add(ROOT / name, arcname=name, recursive=False)
    return buffer.getvalue()


def build(dockerfile: Path, tag: str) -> None:
    started = time.monotonic()
    argv = ["docker", "build", "--force-rm", "--network", "host", "-f", str(dockerfile.relative_to(ROOT)), "-t", tag, "-"]
    result = subprocess.run(argv, input=build_context(), check=False, capture_output=True, timeout=900)
    result = subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(errors="replace"),
                                         result.stderr.decode(errors="replace"))
    assert result.returncode == 0, f"docker build -f {dockerfile.relative_to(ROOT)} failed:\n{tail(result)}"
    print(f"built {tag} in {time.monotonic() - started:.0f} s")


@pytest.fixture(scope="module")
def proxy_image(engine):
    build(DEPLOY / "Dockerfile", PROXY_IMAGE)
    return PROXY_IMAGE


class Container:
    def __init__(self, name: str, port: int):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"

    def inspect(self, template: str) -> str:
        return docker("inspect", "--format", template, self.name).stdout.strip()

    def logs(self) -> list[str]:
        result = docker("logs", self.name)
        return (result.stdout + result.stderr).splitlines()

    def wait_until(self, predicate, what: str, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if predicate():
                return
            assert self.inspect("{{.State.Status}}") == "running", f"{self.name} exited:\n" + "\n".join(self.logs())
            time.sleep(0.5)
        pytest.fail(f"{self.name}: {what} not reached in {timeout_s:.0f} s\n" + "\n".join(self.logs()[-30:]))

    def remove(self) -> None:
        docker("rm", "-f", self.name)


def run(image: str, name: str, port: int, *args: str, docker_args: tuple[str, ...] = ()) -> Container:
    result = docker("run", "-d", "--network", "host", "--name", name, *docker_args, image, *args)
    assert result.returncode == 0, tail(result)
    return Container(name, port)


@pytest.fixture(scope="module")
def proxy(proxy_image):
    """The image as a user runs it: only the port (free, on loopback) and the log format are chosen."""
    port = free_port()
    container = run(proxy_image, f"token-proxy-test-{RUN_ID}", port, "--log-format", "json",
                    "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                    docker_args=("-e", f"TOKEN_PROXY_PORT={port}", "-e", "TOKEN_PROXY_HOST=127.0.0.1"))
    try:
        started = time.monotonic()
        container.wait_until(lambda: container.inspect("{{.State.Health.Status}}") == "healthy",
                             "Docker's health status `healthy`", 240)
        print(f"healthy after {time.monotonic() - started:.0f} s")
        yield container
    finally:
        container.remove()


def test_healthy_container_serves_health_and_metrics(proxy):
    assert httpx.get(f"{proxy.url}/health").status_code == 200
    metrics = httpx.get(f"{proxy.url}/metrics")
    assert metrics.status_code == 200
    assert "token_proxy_requests_total" in metrics.text and "vllm:num_requests_running" in metrics.text


def test_chat_completion_returns_token_ids(proxy):
    resp = httpx.post(f"{proxy.url}/v1/chat/completions", timeout=60,
                      json={"messages": USER, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert list(body) == TOP_KEYS
    (choice,) = body["choices"]
    assert list(choice) == CHOICE_KEYS
    assert body["prompt_token_ids"] == GOLDEN_PROMPT_IDS
    assert choice["token_ids"] and all(isinstance(t, int) for t in choice["token_ids"])
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])


def test_processes_do_not_run_as_root(proxy):
    assert proxy.inspect("{{.Config.User}}") not in ("", "root", "0")
    script = ("import glob, re\n"
              "for status in glob.glob('/proc/[0-9]*/status'):\n"
              "    text = open(status).read()\n"
              "    print(re.search(r'Name:\\s*(\\S+)', text)[1], *re.search(r'Uid:\\s*(.*)', text)[1].split())\n")
    result = docker("exec", proxy.name, "python", "-c", script)
    assert result.returncode == 0, tail(result)
    processes = [line.split() for line in result.stdout.splitlines()]
    assert len(processes) >= 2, processes  # the proxy and its built-in simulator, at least
    assert all(int(uid) != 0 for _, *uids in processes for uid in uids), processes


# `docker run` in front of an SGLang already running on the host (deploy/README.md's recipes) -------------

HUB_ID = "acme/qwen2-tokenizer"  # stands in for the recipe's Qwen/Qwen2.5-7B-Instruct
HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def host_sglang(engine, tokenizer_dir):
    """The simulator on the host's loopback, as the SGLang that is already running."""
    port = free_port()
    sim = subprocess.Popen([sys.executable, "-m", "token_proxy.simulator", "--host", "127.0.0.1", "--port", str(port),
                            "--tokenizer", str(tokenizer_dir), "--incremental-streaming-output"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 120
        while _get(f"http://127.0.0.1:{port}/health") != 200:
            assert sim.poll() is None and time.monotonic() < end, "the host's simulator never became healthy"
            time.sleep(0.2)
        yield port
    finally:
        sim.terminate()
        sim.wait(10)


@pytest.fixture(scope="module")
def mounts(tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    """What the recipes mount: a model directory, and a Hugging Face cache holding HUB_ID (as SGLang's
    download leaves it: refs/main -> snapshots/REV), both readable by the image's unprivileged user."""
    root = tmp_path_factory.mktemp("recipes")
    model = root / "model"
    shutil.copytree(tokenizer_dir, model)
    snapshot = root / "hf-cache" / "hub" / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / HUB_REVISION
    shutil.copytree(tokenizer_dir, snapshot)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # AutoTokenizer reads it for ids
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(HUB_REVISION)
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    return {"/models/Qwen2.5-7B-Instruct": model, "~/.cache/huggingface": root / "hf-cache"}


def recipe_argv(recipe: list[str], name: str, port: int, sglang_port: int, mounts: dict[str, Path]) -> list[str]:
    """deploy/README.md's command with this machine's paths, ports and image; the rest as written."""
    argv = []
    for arg in recipe[2:]:  # after `docker run`
        for placeholder, path in mounts.items():
            if arg.startswith(placeholder + ":"):
                arg = str(path) + arg[len(placeholder):]
        arg = {"token-proxy": name, "sglang-token-proxy": PROXY_IMAGE, "Qwen/Qwen2.5-7B-Instruct": HUB_ID,
               "http://127.0.0.1:30000": f"http://127.0.0.1:{sglang_port}"}.get(arg, arg)
        if arg == PROXY_IMAGE:  # the port is free here, not 8000; every line JSON, to check it
            argv += ["-e", f"TOKEN_PROXY_PORT={port}", "-e", "TOKEN_PROXY_HOST=127.0.0.1", "-e",
                     "TOKEN_PROXY_LOG_FORMAT=json"]
        argv.append(arg)
    return argv


@pytest.mark.parametrize("which", ["tokenizer directory", "hub id from the HF cache"])
def test_docker_run_in_front_of_a_running_sglang(proxy_image, host_sglang, mounts, which):
    recipe = docker_run_recipes()[0 if which == "tokenizer directory" else 1]
    port = free_port()
    name = f"token-proxy-recipe-{RUN_ID}-{'dir' if which == 'tokenizer directory' else 'hub'}"
    argv = recipe_argv(recipe, name, port, host_sglang, mounts)
    result = docker("run", *argv)
    assert result.returncode == 0, tail(result)
    container = Container(name, port)
    try:
        container.wait_until(lambda: _get(f"{container.url}/health") == 200, "/health 200", 120)
        resp = httpx.post(f"{container.url}/v1/chat/completions", timeout=60,
                          json={"messages": USER, "max_tokens": 4, "temperature": 0, "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["prompt_token_ids"] == GOLDEN_PROMPT_IDS
        lines = [json.loads(line) for line in container.logs()]  # every line JSON
        messages = [line.get("message", "") for line in lines]
        expected = "/model (local)" if which == "tokenizer directory" else f"{HUB_ID} (hub id)"
        assert f"loading tokenizer {expected}" in messages, messages
        assert any(m.startswith("serving ") and f"from http://127.0.0.1:{host_sglang}" in m for m in messages)
        print(f"docker run {' '.join(argv)}: healthy, chat 200")
    finally:
        container.remove()


# Prometheus -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prometheus(proxy, tmp_path_factory):
    """deploy/prometheus.yml with its targets on loopback: the proxy, and its built-in simulator as SGLang."""
    build(ROOT / "tests" / "docker" / "prometheus.Dockerfile", PROMETHEUS_IMAGE)
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {"token-proxy": f"127.0.0.1:{proxy.port}", "sglang": f"127.0.0.1:{simulator_port(proxy)}"}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    config_file = tmp_path_factory.mktemp("prometheus") / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    config_file.chmod(0o644)
    config_file.parent.chmod(0o755)
    port = free_port()
    container = run(PROMETHEUS_IMAGE, f"token-proxy-prometheus-{RUN_ID}", port,
                    f"--web.listen-address=127.0.0.1:{port}",
                    docker_args=("-v", f"{config_file}:/etc/prometheus/prometheus.yml:ro"))
    try:
        container.wait_until(lambda: _get(f"{container.url}/-/ready") == 200, "Prometheus ready", 60)
        yield container
    finally:
        container.remove()


def simulator_port(proxy) -> int:
    for line in proxy.logs():
        if found := re.search(r"built-in SGLang simulator on 127\.0\.0\.1:(\d+)", line):
            return int(found[1])
    pytest.fail("the proxy never logged its simulator's port")


def _get(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def query(prometheus, expr: str) -> dict:
    resp = httpx.get(f"{prometheus.url}/api/v1/query", params={"query": expr}, timeout=10)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]


def traffic(proxy) -> None:
    """Plain, streamed and failed requests, so each panel has something to show."""
    body = {"messages": USER, "max_tokens": 8, "return_token_ids": True}
    with httpx.Client(base_url=proxy.url, timeout=60) as client:
        for _ in range(3):
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
                assert resp.status_code == 200 and resp.read()
        assert client.post("/v1/chat/completions", json={"messages": "x"}).status_code == 400


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((DEPLOY / "grafana/dashboards/token-proxy.json").read_text())
    # Grafana's $__rate_interval: at least four scrape intervals; one minute holds enough 5 s scrapes.
    return [(panel["title"], target["expr"].replace("$__rate_interval", "1m"))
            for panel in dashboard["panels"] for target in panel["targets"]]


def test_prometheus_scrapes_the_proxy_and_the_simulator(proxy, prometheus):
    def all_up() -> bool:
        result = query(prometheus, "up")["result"]
        return {r["metric"]["job"]: r["value"][1] for r in result} == {"token-proxy": "1", "sglang": "1"}

    prometheus.wait_until(all_up, "`up` == 1 for the proxy and the simulator", 60)


def test_dashboard_queries_return_data(proxy, prometheus):
    traffic(proxy)
    time.sleep(6)  # one scrape with the first traffic
    traffic(proxy)  # and a later one, so rates are above zero

    def counted() -> bool:
        result = query(prometheus, 'sum(token_proxy_requests_total{endpoint="/v1/chat/completions"})')["result"]
        return bool(result) and float(result[0]["value"][1]) >= 14

    prometheus.wait_until(counted, "the second round of traffic scraped", 60)
    empty = [(title, expr) for title, expr in dashboard_queries() if not query(prometheus, expr)["result"]]
    print(f"dashboard queries with no data (nothing of their kind happened): {[e for _, e in empty]}")
    unexpected = [(title, expr) for title, expr in empty if not any(q in expr for q in QUIET_QUERIES)]
    assert not unexpected, unexpected
    rate = query(prometheus, dashboard_queries()[2][1])["result"]
    assert float(rate[0]["value"][1]) > 0, rate


def test_docker_stop_ends_the_proxy_cleanly(proxy):
    """SIGTERM from `docker stop` drains and exits 0 well before Docker's SIGKILL."""
    started = time.monotonic()
    result = docker("stop", "--time", str(SHUTDOWN_TIMEOUT_S + 20), proxy.name, timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, tail(result)
    assert proxy.inspect("{{.State.ExitCode}}") == "0", proxy.logs()[-20:]
    assert elapsed < SHUTDOWN_TIMEOUT_S, f"docker stop took {elapsed:.1f} s"
    print(f"docker stop: exit 0 after {elapsed:.1f} s")


def test_every_log_line_is_json(proxy):
    """The whole life, shutdown included (runs after `docker stop`): the container runs --log-format json."""
    lines = proxy.logs()
    assert any("listening" in line for line in lines), lines
    not_json = []
    for line in lines:
        try:
            assert isinstance(json.loads(line), dict)
        except (ValueError, AssertionError):
            not_json.append(line)
    assert not not_json, "log lines that are not JSON objects:\n" + "\n".join(not_json)
