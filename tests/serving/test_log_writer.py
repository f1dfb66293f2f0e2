"""The batched log writer: whole lines, at most PIPE_BUF bytes per write, everything written at stop();
and the access log's path around logging (configure_logging's writer alone receives the line)."""

from __future__ import annotations

import atexit
import logging
import os

import orjson

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
        for _ in range(500):
            if path.read_bytes():
                break
            writer._closing.wait(0.01)
        assert path.read_bytes() == b"one\n"
        writer.write_line(b"two\n")
        writer.stop()
    assert path.read_bytes() == b"one\ntwo\n"


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
