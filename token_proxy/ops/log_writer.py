"""The process's one log writer: lines are gathered in memory and a thread writes them, in batches.

The event loop never waits on stderr (a full pipe, a blocked terminal) and pays no queue hand-off and
no thread wake-up per line: adding a line is a deque append, and the writer looks for lines every
`interval_s` on its own (waking it per batch cost the loop ~2.5 % of a request at concurrency 1:
Event.set's notify and the GIL hand-off after it). A look that finds nothing puts it to sleep until the
next line (one Event.set per idle spell, not per line): a process that logs nothing wakes it never, where
a poll every 50 ms cost each process ~1.4 ms of CPU a second, once per serving process with --workers N
(bench/RESULTS.md, issue 30.3). Access lines skip logging's machinery altogether (`write_line`: bytes
already encoded, no LogRecord).

Every os.write holds whole lines only, at most PIPE_BUF bytes unless one line is longer: with
--workers N several processes share stderr, and a pipe writes up to PIPE_BUF atomically (an
O_APPEND file, any size), so the stream stays one line per request.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading

PIPE_BUF = getattr(select, "PIPE_BUF", 4096)


class LogWriter(logging.Handler):
    """A logging handler (records are formatted in the caller's thread) and a sink for encoded lines."""

    def __init__(self, stream, interval_s: float = 0.05):
        super().__init__()
        self.stream = stream
        self.interval_s = interval_s
        self._lines: collections.deque[bytes] = collections.deque()  # append/popleft: thread-safe
        self._write_lock = threading.Lock()  # the writer thread and flush(); never held by emit()
        self._closing = threading.Event()
        self._wake = threading.Event()  # set by the first line after the writer went to sleep, and by close()
        self._asleep = False
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._thread.start()

    def write_line(self, line: bytes) -> None:
        """One encoded line, ending in a newline (the access log's fast path)."""
        self._lines.append(line)
        if self._asleep:  # the first line of a busy spell wakes the writer; the rest are only appended
            self._asleep = False
            self._wake.set()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode("utf-8", "replace")
        except Exception:  # noqa: BLE001 -- logging's own contract: report, never raise
            self.handleError(record)
            return
        self.write_line(line)

    def flush(self) -> None:
        with self._write_lock:
            self._write_pending()

    def close(self) -> None:
        """Stops the thread and writes what is left (at exit: logging.shutdown, or stop())."""
        self._closing.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self.flush()
        super().close()

    stop = close  # configure_logging's callers stop "the listener"

    def _run(self) -> None:
        while not self._closing.is_set():
            if self._lines:
                self.flush()
                self._closing.wait(self.interval_s)  # lines keep coming: gather them (close() ends the wait)
                continue
            self._asleep = True
            if not self._lines:  # else a line came before the flag was up: its writer did not wake us
                self._wake.wait()
            self._wake.clear()
            self._asleep = False

    def _write_pending(self) -> None:
        lines = self._lines
        chunk: list[bytes] = []
        size = 0
        while lines:
            line = lines.popleft()
            if chunk and size + len(line) > PIPE_BUF:
                self._write(b"".join(chunk))
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        if chunk:
            self._write(b"".join(chunk))

    def _write(self, data: bytes) -> None:
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):  # no file descriptor (a test's StringIO)
            self.stream.write(data.decode("utf-8", "replace"))
            self.stream.flush()
            return
        try:
            self.stream.flush()  # anything written through the text layer first stays in order
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            pass  # stderr is gone: nowhere left to report it
