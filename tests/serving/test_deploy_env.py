"""What a deployment meets before the first request (issue 39 items 3 and 7): the variables Kubernetes injects
for a Service named token-proxy, a variable's bad value, the simulator's flags, Ctrl-C while the simulator starts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support.admin_fixtures import free_port, http_status
from tests.support.stderr_lines import StderrLines
from token_proxy.cli import parse_settings

# What the kubelet injects into every pod of the namespace for `kind: Service, name: token-proxy` with one port
# named http (8000) at cluster IP 10.96.12.34 (kubernetes pkg/kubelet/envvars: FromServices, makeLinkVariables).
KUBERNETES_TOKEN_PROXY = {
    "TOKEN_PROXY_SERVICE_HOST": "10.96.12.34",
    "TOKEN_PROXY_SERVICE_PORT": "8000",
    "TOKEN_PROXY_SERVICE_PORT_HTTP": "8000",
    "TOKEN_PROXY_PORT": "tcp://10.96.12.34:8000",
    "TOKEN_PROXY_PORT_8000_TCP": "tcp://10.96.12.34:8000",
    "TOKEN_PROXY_PORT_8000_TCP_PROTO": "tcp",
    "TOKEN_PROXY_PORT_8000_TCP_PORT": "8000",
    "TOKEN_PROXY_PORT_8000_TCP_ADDR": "10.96.12.34",
}
# ... and for a second Service, token-proxy-admin, on UDP port 9000 with no port name.
KUBERNETES_TOKEN_PROXY_ADMIN = {
    "TOKEN_PROXY_ADMIN_SERVICE_HOST": "10.96.12.35",
    "TOKEN_PROXY_ADMIN_SERVICE_PORT": "9000",
    "TOKEN_PROXY_ADMIN_PORT": "udp://10.96.12.35:9000",
    "TOKEN_PROXY_ADMIN_PORT_9000_UDP": "udp://10.96.12.35:9000",
    "TOKEN_PROXY_ADMIN_PORT_9000_UDP_PROTO": "udp",
    "TOKEN_PROXY_ADMIN_PORT_9000_UDP_PORT": "9000",
    "TOKEN_PROXY_ADMIN_PORT_9000_UDP_ADDR": "10.96.12.35",
}


def error_of(capsys, argv, environ) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv, environ)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


def test_kubernetes_service_variables_are_ignored_and_tcp_link_is_not_the_port():
    environ = {**KUBERNETES_TOKEN_PROXY, **KUBERNETES_TOKEN_PROXY_ADMIN}
    assert parse_settings([], environ).port == 8000  # the default: tcp://10.96.12.34:8000 is no port
    assert parse_settings(["--port", "9100"], environ).port == 9100
    assert parse_settings([], {**environ, "TOKEN_PROXY_BACKEND": "http://sglang:30000"}).backend_url == (
        "http://sglang:30000")


def test_a_typo_still_stops_start_up_among_kubernetes_variables(capsys):
    line = error_of(capsys, [], {**KUBERNETES_TOKEN_PROXY, "TOKEN_PROXY_BAKEND": "http://127.0.0.1:30000"})
    assert line == ("token-proxy: error: unknown environment variable TOKEN_PROXY_BAKEND (did you mean "
                    "TOKEN_PROXY_BACKEND?; unset it to start) (see token-proxy --help)")
    # a port given as a number in the variable is still the port; anything else is an error, in argparse's words
    assert parse_settings([], {"TOKEN_PROXY_PORT": "8123"}).port == 8123
    line = error_of(capsys, [], {"TOKEN_PROXY_PORT": "abc"})
    assert line == "token-proxy: error: TOKEN_PROXY_PORT: invalid int value: 'abc' (see token-proxy --help)"


def test_negative_simulator_delays_are_refused(capsys):
    assert error_of(capsys, ["--sim-ttft-ms", "-1"], {}) == (
        "token-proxy: error: --sim-ttft-ms must be >= 0 milliseconds, got -1 (see token-proxy --help)")
    assert error_of(capsys, [], {"TOKEN_PROXY_SIM_TPOT_MS": "-0.5"}) == (
        "token-proxy: error: TOKEN_PROXY_SIM_TPOT_MS (--sim-tpot-ms) must be >= 0 milliseconds, got -0.5 "
        "(see token-proxy --help)")
    assert parse_settings(["--sim-ttft-ms", "0", "--sim-tpot-ms", "2.5"], {}).sim_tpot_ms == 2.5


def test_the_proxy_starts_in_a_pod_with_kubernetes_variables():
    """The whole process, as in a pod of the namespace: it listens and answers (503: no SGLang there)."""
    port, dead = free_port(), free_port()
    env = {**os.environ, **KUBERNETES_TOKEN_PROXY, **KUBERNETES_TOKEN_PROXY_ADMIN}
    proc = subprocess.Popen([sys.executable, "-m", "token_proxy", "--backend", f"http://127.0.0.1:{dead}",
                             "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, status = time.monotonic() + 60, None
        while status is None and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.1)
            status = http_status(port, "/health")
        assert status == 503
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def sigint_as_a_terminal_leaves_it():
    """Children start with SIGINT at its default, as a shell's foreground job does. A suite run in the background
    (`make test &`, nohup, a CI step started with `&`) has SIGINT ignored, and an ignored signal stays ignored
    across exec: the proxy then rightly ignores Ctrl-C too (CPython installs no KeyboardInterrupt handler for an
    inherited SIG_IGN), and this test timed out after 30 s in such whole-suite runs. A Python handler here is
    reset to the default by exec."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _simulators_on(port: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", f"token_proxy.simulator --host 127.0.0.1 --port {port} "],
                           capture_output=True, text=True, check=False).stdout
    return [int(pid) for pid in found.split()]


def test_ctrl_c_while_the_simulator_starts_prints_no_traceback():
    """A terminal's Ctrl-C goes to the whole foreground process group: the proxy and its simulator child (in a
    session of its own, so the proxy stops it). No traceback, exit 130, and no simulator left running."""
    with sigint_as_a_terminal_leaves_it():
        proc = subprocess.Popen([sys.executable, "-m", "token_proxy", "--host", "127.0.0.1", "--port", "0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    sim_port = None
    try:
        err = StderrLines(proc)
        starting = err.wait_for(lambda line: "starting the built-in SGLang simulator" in line, timeout=60)
        sim_port = re.search(r"simulator on 127\.0\.0\.1:(\d+)", starting).group(1)
        time.sleep(0.3)  # the child is importing (it takes seconds): Ctrl-C lands while it starts
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130, err.text
        text = err.wait_eof(timeout=30)  # every writer gone: the simulator too (it shares the proxy's stderr)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = _simulators_on(sim_port) if sim_port else []
        for pid in left:  # a proxy killed above cannot stop its simulator: this test does
            os.kill(pid, signal.SIGKILL)
    assert left == []
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert "interrupted before the proxy started serving" in text


def test_ctrl_c_while_popen_runs_still_stops_the_simulator_child(monkeypatch):
    """Ctrl-C inside subprocess.Popen, after its fork (a window a loaded machine widens), used to raise
    KeyboardInterrupt there: Popen never returned the child, so nothing stopped it and it kept the proxy's
    stderr and a port. Now the interrupt waits until the child is known, then stops it."""
    from token_proxy.cli import start
    from token_proxy.settings import Settings

    real_popen, started = subprocess.Popen, []

    def popen_hit_by_ctrl_c(cmd, **kwargs):
        child = real_popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)
        started.append(child)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, delivered before Popen returns
        time.sleep(0.1)
        return child

    monkeypatch.setattr(start.subprocess, "Popen", popen_hit_by_ctrl_c)
    monkeypatch.setattr(start, "_wait_for_health", lambda *args, **kwargs: pytest.fail("the start went on"))
    try:
        with pytest.raises(KeyboardInterrupt), start.simulator_process(Settings()):
            pytest.fail("the simulator was served")
        assert started[0].wait(timeout=15) == -signal.SIGTERM  # stopped, not left running
    finally:
        started[0].kill()
        started[0].wait()


def test_the_readme_curl_names_the_model_make_run_serves():
    """`make run` with no BACKEND: the CLI's simulator, started without --model-path, serves SimConfig's name."""
    from tests.serving.test_readme import curl_example
    from token_proxy.simulator import SimConfig

    _, _, body = curl_example()
    assert body["model"] == SimConfig.model_path == "sim/qwen2-tiny"
