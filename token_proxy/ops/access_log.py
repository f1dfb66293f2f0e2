"""One JSON line per request (named by pipeline/request_state.py's X-Request-Id) and the process's log setup.

Lines leave the event loop through one LogWriter (log_writer.py): a thread writes them in batches of
whole lines, so a slow stderr (a full pipe, a blocked terminal) never stalls requests, and with
--workers N the processes sharing stderr never split each other's lines. An access line costs the
loop a dict, one orjson.dumps and a deque append: no LogRecord, no queue hand-off per request.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time

import orjson
from aiohttp import web

from token_proxy.http_io import route_of
from token_proxy.ops.log_writer import LogWriter
from token_proxy.pipeline.request_state import RequestStats, request_id_of

ACCESS_LOGGER = "token_proxy.access"
access_log = logging.getLogger(ACCESS_LOGGER)

# With --workers N: this serving process's number, in every access line (its key stays "worker", as logged
# since --workers came: log pipelines read it).
PROCESS_INDEX = web.AppKey("process_index", int)


def log_request(request: web.Request, endpoint: str, status: int, stats: RequestStats,
                latency_s: float) -> None:
    route = route_of(request.app, endpoint)
    level = logging.DEBUG if route is not None and route.quiet else logging.INFO  # probes and scrapes
    if not access_log.isEnabledFor(level):
        return
    fields = {
        "ts": round(time.time(), 6),
        "request_id": request_id_of(request),
        "method": request.method,
        "endpoint": endpoint,
        "path": request.path,
        "status": status,
        "stream": stats.stream,
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "cached_tokens": stats.cached_tokens,
        "latency_s": round(latency_s, 6),
        "ttft_s": _since_start(stats, stats.first_token_at),
        # Where a late first token went: parse + render + admission before SGLang was called (sent_s),
        # the render itself (render_s, cache misses), and SGLang's part (ttft_s - sent_s).
        "sent_s": _since_start(stats, stats.sent_at),
        "render_s": round(stats.render_s, 6),
        "backend_rid": stats.backend_rid,
        "weight_version": stats.weight_version,
        "adapter": stats.adapter,
        "prompt_cache_hit": stats.prompt_cache_hit,
        "client_disconnected": stats.client_disconnected,
    }
    worker = request.app.get(PROCESS_INDEX)
    if worker is not None:
        fields["worker"] = worker
    writer = sole_writer()
    if writer is not None:  # the CLI's set-up: no LogRecord, no formatting, no lock
        writer.write_line(orjson.dumps(fields, option=orjson.OPT_APPEND_NEWLINE))
    else:
        access_log.log(level, orjson.dumps(fields).decode(), extra={"access": fields})


def sole_writer() -> LogWriter | None:
    """The LogWriter that configure_logging installed, when an access record would reach it alone
    (any other handler, such as a test's caplog, gets records as usual)."""
    if access_log.handlers or not access_log.propagate:
        return None
    handlers = logging.root.handlers
    return handlers[0] if len(handlers) == 1 and type(handlers[0]) is LogWriter else None


def _since_start(stats: RequestStats, at: float | None) -> float | None:
    return None if at is None else round(at - stats.started_at, 6)


class JsonFormatter(logging.Formatter):
    """The proxy's own log lines as JSON objects (--log-format json)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name,
                "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


# Libraries that print through handlers of their own (transformers adds a stderr handler on import,
# and its "PyTorch was not found" advisory with it; huggingface_hub too, and propagates as well, so its
# download retries printed twice): their records go through the proxy's handlers.
LIBRARY_LOGGERS = ("transformers", "huggingface_hub")


def configure_logging(level: str, fmt: str = "text", repeat_interval_s: float = 10.0,
                      access_lines: bool = True) -> LogWriter:
    """Root logging for the CLI: every line goes to stderr through one LogWriter (a thread writes
    batches of whole lines); access lines are written as they are (already JSON), everything else
    as text or JSON. Repeated warnings (the same message template) are written once per
    `repeat_interval_s`, with a count. access_lines=False (--disable-log-requests): no per-request
    line at all (log_request asks isEnabledFor first, so this costs nothing per request).
    Returns the writer (`stop()` writes what is left)."""
    # Advice meant for notebook users (e.g. "PyTorch was not found"): the proxy never needs torch.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    console = JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    writer = LogWriter(sys.stderr)
    writer.setFormatter(AccessAsIs(console))
    writer.addFilter(RepeatFilter(repeat_interval_s))
    root = logging.getLogger()
    root.handlers[:] = [writer]
    root.setLevel(level.upper())
    access_log.disabled = not access_lines
    for name in LIBRARY_LOGGERS:  # before their import: a logger-level filter sees records first
        library = logging.getLogger(name)
        if not any(isinstance(f, _ToRoot) for f in library.filters):
            library.addFilter(_ToRoot())
    adopt_library_loggers()
    logging.captureWarnings(True)  # Python warnings (deprecations) as records on the "py.warnings" logger
    atexit.register(writer.stop)  # writes what is still gathered
    return writer


class AccessAsIs(logging.Formatter):
    """Access lines are JSON already: written as they are; every other record by `other`."""

    def __init__(self, other: logging.Formatter):
        super().__init__()
        self.other = other

    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage() if record.name == ACCESS_LOGGER else self.other.format(record)


def adopt_library_loggers() -> None:
    """Drop the stderr handlers libraries gave themselves (call after importing them), so their
    records reach the proxy's handlers."""
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers[:] = []
        library.propagate = True


class _ToRoot(logging.Filter):
    """A logger-level filter that hands the record to the root's handlers and stops it there: it
    never reaches a handler the library installed for itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        root = logging.getLogger()
        if record.levelno >= root.getEffectiveLevel():
            for handler in root.handlers:
                handler.handle(record)
        return False


class RepeatFilter(logging.Filter):
    """Rate-limits repeated WARNING+ records (same logger and message template): the first passes,
    the rest within `interval_s` are counted, and the next one after it says how many were held back.
    An outage that fails every request logs a line per interval, not one per request."""

    def __init__(self, interval_s: float = 10.0, clock=time.monotonic):
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._seen: dict[tuple, list] = {}  # key -> [last written at, held back since]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or self.interval_s <= 0:
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            return False
        held = seen[1] if seen is not None else 0
        if len(self._seen) > 1000:
            self._seen.clear()
        self._seen[key] = [now, 0]
        if held:
            record.msg = f"{record.getMessage()} [{held} more like this in the last {self.interval_s:g} s]"
            record.args = None
        return True
