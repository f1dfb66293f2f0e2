"""The image's HEALTHCHECK (token_proxy/cli/healthcheck.py) asks the port the proxy was started with, whether a
flag or a TOKEN_PROXY_* variable gave it (issue 31: `docker run IMAGE --port N` stayed "starting")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from token_proxy.cli.healthcheck import health_url, main, proxy_argv_env


def exec_done(pid: int, marker: str) -> None:
    """Until the child has exec'd (its /proc cmdline is the new program's, not the forked parent's)."""
    for _ in range(500):
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            if marker.encode() in file.read():
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never ran {marker}")


def test_the_flag_wins_over_the_image_env():
    assert health_url(["--port", "9123"], {"TOKEN_PROXY_PORT": "8000"}) == "http://127.0.0.1:9123/health"
    assert health_url([], {"TOKEN_PROXY_PORT": "8001", "TOKEN_PROXY_HOST": "0.0.0.0"}) == \
        "http://127.0.0.1:8001/health"
    assert health_url(["--host", "::", "--port=7"], {}) == "http://[::1]:7/health"
    assert health_url(["--host", "10.1.2.3"], {}) == "http://10.1.2.3:8000/health"
    assert health_url(["--ssl-certfile", "/c.pem"], {}) == "https://127.0.0.1:8000/health"


def test_argv_and_env_are_read_from_the_proxy_process(tmp_path):
    script = tmp_path / "token-proxy"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(30)\n")
    script.chmod(0o755)
    proc = subprocess.Popen([str(script), "--port", "9123", "--log-format", "json"],
                            env={"TOKEN_PROXY_HOST": "127.0.0.2", "PATH": "/usr/bin"})
    try:
        exec_done(proc.pid, "9123")
        argv, environ = proxy_argv_env(proc.pid)
        assert argv == ["--port", "9123", "--log-format", "json"]
        assert environ["TOKEN_PROXY_HOST"] == "127.0.0.2"
        assert health_url(argv, environ) == "http://127.0.0.2:9123/health"
        assert main(proc.pid) == 1  # nothing listens there
    finally:
        proc.kill()
        proc.wait()


def test_python_dash_m_is_understood(tmp_path):
    code = textwrap.dedent("""
        import sys, time
        time.sleep(30)
    """)
    module = tmp_path / "token_proxy_stub.py"
    module.write_text(code)
    proc = subprocess.Popen([sys.executable, "-m", "token_proxy_stub", "--port", "9124"], cwd=tmp_path)
    try:
        exec_done(proc.pid, "9124")
        assert proxy_argv_env(proc.pid)[0] == ["--port", "9124"]
    finally:
        proc.kill()
        proc.wait()
