"""The batched log writer: whole lines, at most PIPE_BUF bytes per write, everything written at stop();
and the access log's path around logging (configure_logging's writer alone receives the line)."""

from __future__ import annotations

import atexit
import logging
import os

import orjson
import pytest

from token_proxy.ops import configure_logging, log_writer
from token_proxy.ops.access_log import ACCESS_LOGGER, sole_writer
from token_proxy.ops.log_writer import PIPE_BUF, LogWriter


def test_batches_hold_whole_lines_of_at_most_pipe_buf_bytes(tmp_path, monkeypatch):
    writes: list[bytes] = []
    real_write = os.write

    def recording_write(fd, data):
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(log_writer.os, "write", recording_write)
    path = tmp_path / "err.log"
    with open(path, "a") as stream:
        writer = LogWriter(stream, interval_s=10.0)  # nothing leaves before stop()
        lines = [b"%04d %s\n" % (i, b"x" * 90) for i in range(100)] + [b"L" * (2 * PIPE_BUF) + b"\n", b"last\n"]
        for line in lines:
            writer.write_line(line)
        assert writes == []
        writer.stop()
    assert path.read_bytes() == b"".join(lines)
    assert all(w.endswith(b"\n") for w in writes)
    assert [len(w) for w in writes if len(w) > PIPE_BUF] == [2 * PIPE_BUF + 1]  # the one longer line, alone
    assert len(writes) == 5  # 100 lines of 96 bytes: 42 + 42 + 16 per write, then the long one, then "last"


def test_the_thread_writes_within_its_interval(tmp_path):
    path = tmp_path / "err.log"
    with open(path, "a") as stream:
        writer = LogWriter(stream, interval_s=0.01)
        writer.write_line(b"one\n")
        assert written(path, writer, 5.0) == b"one\n"
        writer.write_line(b"two\n")
        writer.stop()
    assert path.read_bytes() == b"one\ntwo\n"


def written(path, writer, within_s: float) -> bytes:
    """What the writer's thread has put in the file once anything is there (or after `within_s`)."""
    for _ in range(int(within_s / 0.005)):
        if path.read_bytes():
            break
        writer._closing.wait(0.005)
    return path.read_bytes()


def _timeslices(thread) -> int:
    with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
        return int(f.read().split()[2])


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the thread's schedstat (Linux)")
def test_an_idle_writer_sleeps_until_a_line_comes(tmp_path):
    """A process that logs nothing pays no wake-ups for its writer (issue 30.3: a poll every interval cost
    each --workers process ~1.4 ms of CPU a second); the first line after the idle spell wakes it."""
    path = tmp_path / "err.log"
    with open(path, "a") as stream:
        writer = LogWriter(stream, interval_s=0.005)
        writer._closing.wait(0.05)  # the thread finds nothing and goes to sleep
        before = _timeslices(writer._thread)
        writer._closing.wait(0.3)  # polling every 5 ms would be ~60 wake-ups
        assert _timeslices(writer._thread) - before == 0
        writer.write_line(b"after the idle spell\n")
        assert written(path, writer, 1.0) == b"after the idle spell\n"
        writer.write_line(b"busy 1\n")
        writer.write_line(b"busy 2\n")
        writer.stop()
    assert path.read_bytes() == b"after the idle spell\nbusy 1\nbusy 2\n"
    assert not writer._thread.is_alive()


async def test_configured_access_lines_bypass_log_records(make_sim, make_proxy, tmp_path, monkeypatch):
    path = tmp_path / "err.log"
    stream = open(path, "a")  # noqa: SIM115, ASYNC230 -- closed below, after the writer stopped
    monkeypatch.setattr("sys.stderr", stream)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    records: list[logging.LogRecord] = []
    try:
        writer = configure_logging("info", "text")
        assert sole_writer() is writer
        logging.getLogger(ACCESS_LOGGER).addFilter(records.append)  # a record would be seen here
        proxy = await make_proxy(await make_sim())
        resp = await proxy.post("/tokenize", json={"prompt": "hi"}, headers={"X-Request-Id": "fast-1"})
        assert resp.status == 200
        await proxy.close()
        logging.getLogger("token_proxy.test").warning("a %s line", "console")
        writer.stop()
        atexit.unregister(writer.stop)
    finally:
        logging.getLogger(ACCESS_LOGGER).filters.clear()
        root.handlers[:], level = saved
        root.setLevel(level)
        stream.close()
    assert records == []
    lines = path.read_text().splitlines()
    (access,) = [orjson.loads(line) for line in lines if line.startswith("{")]
    assert (access["request_id"], access["endpoint"], access["status"]) == ("fast-1", "/tokenize", 200)
    assert any(line.endswith("WARNING token_proxy.test: a console line") for line in lines)


def test_other_handlers_get_access_records(caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    assert sole_writer() is None  # the test's capture handler sits beside any writer
