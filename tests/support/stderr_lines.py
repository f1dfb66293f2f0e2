"""A child process's stderr read line by line in a thread, so that a test waits for the line it needs (a
readiness signal) under a deadline, instead of sleeping for a guessed time or blocking on a pipe that a
grandchild may hold open."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable


class StderrLines:
    """The lines `proc` (started with stderr=PIPE, text=True) has written so far."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._lines: list[str] = []
        self._eof = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    @property
    def text(self) -> str:
        with self._changed:
            return "".join(self._lines)

    def wait_for(self, predicate: Callable[[str], bool], timeout: float) -> str:
        """The first line (from the start) for which `predicate` is true; AssertionError with what was written
        if none came within `timeout` seconds or stderr ended without one."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((line for line in self._lines if predicate(line)), None)
                left = deadline - time.monotonic()
                if found is not None:
                    return found
                if self._eof or left <= 0:
                    raise AssertionError(f"no such line in {timeout:g} s (exit status {self.proc.poll()}): "
                                         + "".join(self._lines)[-3000:])
                self._changed.wait(left)

    def wait_eof(self, timeout: float) -> str:
        """All of stderr, once every writer closed it; AssertionError naming who still holds it open."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self._eof:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"stderr still open after {timeout:g} s (exit status {self.proc.poll()}; "
                                         "a child left running holds it?): " + "".join(self._lines)[-3000:])
                self._changed.wait(left)
            return "".join(self._lines)
