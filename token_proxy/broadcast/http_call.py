"""One POST to SGLang or the proxy in a daemon thread of its own, that the trainer can cancel.

A push runs an HTTP call beside a collective, and whichever fails first ends both: `cancel()` shuts the
call's socket down, so its thread ends at once (the server sees the client leave) instead of holding a
worker until its socket timeout."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import threading
import urllib.parse


class HTTPCall:
    """`future` resolves to (status, message); status 0: unreachable, or cancelled."""

    def __init__(self, url: str, body: dict, timeout_s: float):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._connection: http.client.HTTPConnection | None = None
        self._cancelled = False
        threading.Thread(target=self._run, args=(url, body, timeout_s), name="broadcaster-http",
                         daemon=True).start()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled, connection = True, self._connection
        sock = connection.sock if connection is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass

    def _run(self, url: str, body: dict, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname or "localhost", parts.port, timeout=timeout_s)
        with self._lock:
            cancelled, self._connection = self._cancelled, connection
        try:
            if cancelled:
                raise ConnectionAbortedError("cancelled")
            connection.request("POST", parts.path or "/", body=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
            with self._lock:
                if self._cancelled:  # cancel() may have come between connect and now
                    raise ConnectionAbortedError("cancelled")
            response = connection.getresponse()
            status, raw = response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.future.set_result((0, f"{url} is unreachable: {exc}" if not self._cancelled else "cancelled"))
            return
        finally:
            connection.close()
        self.future.set_result(_result(status, raw))


class FanOutCall:
    """The same call to several servers at once (one proxy per inference node, issue 37): `future` resolves
    to the first failure, named by its server, as soon as one fails, else to (200, the last message) once
    all answered; `cancel()` cancels every call."""

    def __init__(self, calls: list[tuple[str, dict]], timeout_s: float):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._urls = [url for url, _ in calls]
        self._calls = [HTTPCall(url, body, timeout_s) for url, body in calls]
        self._left = len(self._calls)
        self._lock = threading.Lock()
        for url, call in zip(self._urls, self._calls):
            call.future.add_done_callback(lambda done, url=url: self._done(url, done.result()))

    def _done(self, url: str, result: tuple[int, str]) -> None:
        with self._lock:
            self._left -= 1
            if self.future.done():
                return
            status, message = result
            if status != 200:
                self.future.set_result((status, f"{url.split('/', 3)[2]}: {message}"))
            elif self._left == 0:
                self.future.set_result(result)

    def cancel(self) -> None:
        for call in self._calls:
            call.cancel()


def _result(status: int, raw: bytes) -> tuple[int, str]:
    """(status, SGLang's or the proxy's message); {"success": false} under 200 counts as 400."""
    message = _message(raw)
    if status == 200 and '"success":false' in raw.decode("utf-8", "replace").replace(" ", ""):
        return 400, message
    return status, message


def _message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace").strip()
    if isinstance(body, dict):
        error = body.get("error")
        text = body.get("message") or body.get("error_message") or (
            error.get("message") if isinstance(error, dict) else error)
        if text:
            return str(text)
    return json.dumps(body)
