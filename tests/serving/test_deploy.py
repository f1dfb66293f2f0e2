"""deploy/ without a Docker engine: the compose files against the compose-spec schema and the
stack's wiring, the image's entry command and healthcheck run for real, the Prometheus config, and
every dashboard query's metric names against what a live proxy exports."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.admin_fixtures import free_port
from tests.support.golden import golden_file
from token_proxy.cli import parse_settings
from token_proxy.cli.flags import FLAGS
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.metrics import NAMES as SIM_NAMES
from token_proxy.simulator.metrics import set_sglang_metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SERVICES = {"sglang", "proxy", "prometheus", "grafana"}


class ComposeLoader(yaml.SafeLoader):
    """Compose's merge tags (!reset, !override) carry their value."""


def _tagged_value(loader: yaml.SafeLoader, node: yaml.Node):
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    return loader.construct_scalar(node)


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(_tag, _tagged_value)


def load(name: str):
    return yaml.load((DEPLOY / name).read_text(), Loader=ComposeLoader)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load("docker-compose.yml")


@pytest.fixture(scope="module")
def sim_override() -> dict:
    return load("docker-compose.sim.yml")


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.sim.yml"])
def test_compose_files_follow_the_compose_spec(name):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("check_jsonschema")
    schema_file = resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(load(name)), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]


def test_compose_wiring(compose):
    services = compose["services"]
    assert set(services) == SERVICES
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] == "CMD", name
    sglang, proxy = services["sglang"], services["proxy"]
    assert _expand({"image": sglang["image"]})["image"].split(":")[0] == "lmsysorg/sglang"  # the official image
    assert {"--enable-metrics", "--incremental-streaming-output"} <= set(sglang["command"])
    (gpu,) = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    sglang_port = sglang["command"][sglang["command"].index("--port") + 1]
    assert proxy["environment"]["TOKEN_PROXY_BACKEND"] == f"http://sglang:{sglang_port}"
    # The proxy starts with SGLang (its port opens at once, /health says why it cannot serve yet), not
    # after SGLang turns healthy (up to 900 s of silence).
    assert proxy["depends_on"]["sglang"]["condition"] == "service_started"
    assert _seconds(proxy["healthcheck"]["start_period"]) >= _seconds(sglang["healthcheck"]["start_period"])
    assert proxy["build"]["dockerfile"] == "deploy/Dockerfile"
    assert (DEPLOY / proxy["build"]["context"]).resolve() == ROOT
    # The model and tokenizer live in one volume: SGLang writes it, the proxy reads it.
    assert "hf-cache" in compose["volumes"]
    sglang_cache = _mount(sglang, "hf-cache")
    proxy_cache = _mount(proxy, "hf-cache")
    assert sglang_cache.split(":")[1] == sglang["environment"]["HF_HOME"]
    assert proxy_cache.split(":")[1:] == [proxy["environment"]["HF_HOME"], "ro"]
    for service in services.values():  # bind mounts point at files that exist
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), source


def test_proxy_environment_is_real_flags(compose, sim_override):
    known = {"TOKEN_PROXY_" + flag[2:].upper().replace("-", "_") for flag, *_ in FLAGS}
    gpu_env = compose["services"]["proxy"]["environment"]
    sim_env = {**gpu_env, **sim_override["services"]["proxy"]["environment"]}
    for env in (gpu_env, sim_env):
        assert {k for k in env if k.startswith("TOKEN_PROXY_")} <= known
    assert parse_settings([], environ=_expand(gpu_env)).backend_url == "http://sglang:30000"
    sim = parse_settings([], environ=_expand(sim_env))
    assert not sim.backend_url and not sim.tokenizer  # the CLI starts its simulator


def test_gpu_less_override(sim_override):
    services = sim_override["services"]
    assert services["sglang"]["profiles"] == ["gpu"]  # not started by default
    assert services["proxy"]["depends_on"] == {} and services["proxy"]["volumes"] == []
    assert "!reset {}" in (DEPLOY / "docker-compose.sim.yml").read_text()  # a plain {} would merge, not clear


def _fake_docker(tmp_path: Path, compose: bool) -> dict:
    """PATH with a `docker` that has the compose plugin or not (docker's own answer without it)."""
    script = tmp_path / "docker"
    plugin = 'echo "Docker Compose version v2.29.7"; exit 0' if compose else (
        'echo "docker: \'compose\' is not a docker command." >&2; exit 1')
    script.write_text(f'#!/bin/sh\nif [ "$1" = compose ]; then {plugin}; fi\nexit 0\n')
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}


def test_makefile_up_and_down(tmp_path):
    env = _fake_docker(tmp_path, compose=True)

    def dry(*args):
        return subprocess.run(["make", "-s", "-n", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True, env=env).stdout.split()

    assert dry("up")[:5] == ["docker", "compose", "-f", "deploy/docker-compose.yml", "up"]
    sim = dry("up", "SIM=1")
    assert sim[sim.index("-f", 3) + 1] == "deploy/docker-compose.sim.yml" and "--build" in sim
    assert dry("down")[-2:] == ["down", "--remove-orphans"]


@pytest.mark.parametrize("target", ["up", "down"])
def test_makefile_says_when_the_compose_plugin_is_missing(tmp_path, target):
    """Not docker's "unknown shorthand flag: 'f' in -f": one line naming the plugin and how to get it."""
    result = subprocess.run(["make", "-s", target], cwd=ROOT, capture_output=True, text=True, check=False,
                            env=_fake_docker(tmp_path, compose=False))
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert re.fullmatch(rf"Makefile:\d+: \*\*\* make {target}: `docker compose` \(Docker's Compose v2 plugin, "
                        r">= 2\.24\.4\) is not installed: install the docker-compose-plugin package \(Docker's apt "
                        r"repository, https://docs\.docker\.com/compose/install/linux/; Ubuntu: docker-compose-v2\)\."
                        r"  Stop\.", line), line


def docker_run_recipes(readme: Path = DEPLOY / "README.md") -> list[list[str]]:
    """The `docker run` commands a README shows (tests/serving/test_image.py runs deploy/README's for real)."""
    blocks = re.findall(r"```\n(docker run .*?)```", readme.read_text(), re.DOTALL)
    return [shlex.split(block.replace("\\\n", " ")) for block in blocks]


def test_readmes_show_docker_run_in_front_of_a_running_sglang():
    """Both READMEs: the proxy container at an SGLang already running on the host, the tokenizer as a
    mounted directory or as a hub id from the mounted Hugging Face cache, offline."""
    for readme in (DEPLOY / "README.md", ROOT / "README.md"):
        directory, hub = docker_run_recipes(readme)
        for argv in (directory, hub):
            assert argv[:5] == ["docker", "run", "-d", "--name", "token-proxy"] and "--network" in argv
            image = argv.index("sglang-token-proxy")
            assert argv[image + 1:image + 3] == ["--backend", "http://127.0.0.1:30000"]
            assert argv[image + 3] == "--tokenizer"
        mount = directory[directory.index("-v") + 1]
        assert mount.endswith(":ro") and mount.split(":")[1] == directory[-1]  # --tokenizer is the mount
        assert {"HF_HOME=/hf-cache", "HF_HUB_OFFLINE=1"} <= set(hub) and hub[hub.index("-v") + 1].endswith(
            ":/hf-cache:ro")
        assert "--add-host=host.docker.internal:host-gateway" in readme.read_text()


def test_dockerfile_is_slim_non_root_with_a_healthcheck():
    steps = _dockerfile()
    froms = [args for op, args in steps if op == "FROM"]
    assert froms and all("-slim" in image.split()[0] for image in froms)
    (user,) = [args for op, args in steps if op == "USER"]
    assert user not in ("root", "0")
    (health,) = [args for op, args in steps if op == "HEALTHCHECK"]
    assert "--interval" in health and " CMD [" in health
    (entry,) = [json.loads(args) for op, args in steps if op == "ENTRYPOINT"]
    assert entry == ["token-proxy"]


async def test_image_entry_command_serves_health_and_metrics(make_sim, tokenizer_dir):
    """The ENTRYPOINT with the image's ENV, run directly on loopback; the HEALTHCHECK command decides (given the
    proxy's pid: in the image the proxy is PID 1, which the check reads by default)."""
    sim = await make_sim()
    steps = _dockerfile()
    env = {**os.environ, **_dockerfile_env(steps)}
    port = free_port()
    env.update(TOKEN_PROXY_HOST="127.0.0.1", TOKEN_PROXY_PORT=str(port), TOKEN_PROXY_BACKEND=str(sim.make_url("")),
               TOKEN_PROXY_TOKENIZER=str(tokenizer_dir), TOKEN_PROXY_LOG_FORMAT="json")
    (entry,) = [json.loads(args) for op, args in steps if op == "ENTRYPOINT"]
    binary = Path(sys.executable).with_name(entry[0])
    proc = await asyncio.create_subprocess_exec(str(binary), *entry[1:], env=env, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.PIPE)
    try:
        health = _healthcheck_argv(steps)
        for _ in range(300):
            check = await asyncio.create_subprocess_exec(*health, str(proc.pid), env=env, stderr=subprocess.DEVNULL)
            if await check.wait() == 0:
                break
            assert proc.returncode is None, (await proc.stderr.read()).decode()[-2000:]
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the image's healthcheck never passed")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = await reader.read()
        writer.close()
        assert raw.startswith(b"HTTP/1.1 200") and b"token_proxy_requests_total" in raw
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
    log = [json.loads(line) for line in (await proc.stderr.read()).decode().splitlines()]  # all JSON
    assert any(line.get("logger") == "token_proxy" and "listening" in line["message"] for line in log)


def test_prometheus_config_says_what_to_scrape_outside_compose():
    """The targets are compose host names; the file says what to write without compose."""
    text = (DEPLOY / "prometheus.yml").read_text()
    assert '["127.0.0.1:8000"] for token-proxy and ["127.0.0.1:30000"] for' in " ".join(
        line.lstrip("# ") for line in text.splitlines())
    readme = (DEPLOY / "README.md").read_text()
    assert "127.0.0.1:8000" in readme and "prometheus.yml" in readme


def test_prometheus_scrapes_the_proxy_and_sglang(compose):
    config = load("prometheus.yml")
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    proxy_port = compose["services"]["proxy"]["ports"][0].split(":")[-1]
    assert targets["token-proxy"] == [f"proxy:{proxy_port}"]
    assert targets["sglang"] == [f"sglang:{_sglang_port(compose)}"]
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in config["scrape_configs"])


def test_grafana_provisioning(compose):
    datasource = load("grafana/provisioning/datasources/prometheus.yml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and datasource["type"] == "prometheus"
    provider = load("grafana/provisioning/dashboards/dashboards.yml")["providers"][0]
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith("."))
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    dashboard = _dashboard()
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {datasource["uid"]}
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("request rate", "latency", "tokens per second", "in flight", "errors", "weight version"):
        assert topic in titles, topic


PROMQL_WORDS = {"sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "by",
                "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset", "topk", "bottomk", "abs", "clamp_min", "clamp_max", "time", "vector", "scalar"}


def promql_metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges, $__rate_interval included
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    return {w for w in re.findall(r"(?<![\w.$])[A-Za-z_:][\w:]*", expr) if w not in PROMQL_WORDS}


async def test_every_dashboard_query_names_real_metrics(make_sim, make_proxy):
    """Names checked against a live proxy's /metrics (vllm: view fresh) and SGLang's real page."""
    sim = await make_sim()
    set_sglang_metrics(sim.app[SIM_STATE], num_retracted_requests_total=1)
    proxy = await make_proxy(sim, backend_metrics_interval_s=0.02)
    await proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 2, "stream": True})
    exported: set[str] = set()
    for _ in range(150):
        exported = _exported_names(await (await proxy.get("/metrics")).text())
        if "vllm:num_requests_running" in exported:
            break
        await asyncio.sleep(0.02)
    recorded = golden_file("throughput.json", optional=True)  # absent: the simulator's names stand in
    sglang = set(json.loads(recorded.read_text())["metrics"]["metric_names"]) if recorded else SIM_NAMES
    used = set()
    for panel in _dashboard()["panels"]:
        for target in panel["targets"]:
            names = promql_metric_names(target["expr"])
            assert names, target["expr"]
            used |= names
            for name in names:
                known = sglang if name.startswith("sglang:") else exported
                assert name in known, f"{panel['title']}: {name} is not exported"
    assert {"vllm:num_requests_running", "token_proxy_weight_version", "sglang:num_queue_reqs"} <= used


def test_promql_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le, endpoint) (rate(a_bucket{endpoint!~"/x|/y", le="+Inf"}'
            '[$__rate_interval]))) / on (job) vllm:b_total offset 5m')
    assert promql_metric_names(expr) == {"a_bucket", "vllm:b_total"}


def _exported_names(text: str) -> set[str]:
    """Sample names, plus those of families with no sample yet (labelled metrics never observed)."""
    names = set()
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""], "info": ["_info"]}
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in suffixes.get(family.type, [""])}
    return names


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana/dashboards/token-proxy.json").read_text())


def _mount(service: dict, volume: str) -> str:
    (mount,) = [v for v in service["volumes"] if v.split(":")[0] == volume]
    return mount


def _sglang_port(compose: dict) -> str:
    command = compose["services"]["sglang"]["command"]
    return command[command.index("--port") + 1]


def _seconds(duration: str) -> int:
    value, unit = re.fullmatch(r"(\d+)([sm])", duration).groups()
    return int(value) * (60 if unit == "m" else 1)


def _expand(env: dict) -> dict:
    """${VAR:-default} as compose would expand it with VAR unset."""
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


def _dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "Dockerfile").read_text())
    steps = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, args = line.partition(" ")
            steps.append((op.upper(), args.strip()))
    return steps


def _dockerfile_env(steps) -> dict:
    env = {}
    for op, args in steps:
        if op == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                if key != "PATH":
                    env[key] = value
    return env


def _healthcheck_argv(steps) -> list[str]:
    (health,) = [args for op, args in steps if op == "HEALTHCHECK"]
    argv = json.loads(health[health.index(" CMD ") + 5:])
    return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


def test_a_build_without_buildkit_sends_the_same_small_context():
    """Without BuildKit, docker reads the root .dockerignore, not deploy/Dockerfile.dockerignore: the
    same rules, or a legacy build sends .venv and every cache (534.5 MB once)."""
    root = Path(__file__).resolve().parents[2]

    def rules(path: Path) -> list[str]:
        return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]

    assert rules(root / ".dockerignore") == rules(root / "deploy" / "Dockerfile.dockerignore")
    assert rules(root / ".dockerignore")[:2] == ["**", "!pyproject.toml"]
