"""The ways SGLang refuses a request, each with the exact body it sends."""

from __future__ import annotations

import orjson
from aiohttp import web

# FastAPI's RequestValidationError text names the file, line and function of the route.
_HTTP_SERVER = "/tmp/site/sglang/srt/entrypoints/http_server.py"
GENERATE_ROUTE = (869, "generate_request", "POST /generate")


class SimError(Exception):
    """Base: an error that becomes one HTTP response."""

    def response(self) -> web.Response:
        raise NotImplementedError


class BadRequest(SimError):
    """A ValueError in SGLang's tokenizer manager: 400 {"error": {"message"}}."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def response(self) -> web.Response:
        return json_response({"error": {"message": self.message}}, status=400)

    def stream_payload(self) -> dict:
        """The same error sent inside an SSE stream (under HTTP 200)."""
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
        }


class ContractError(SimError):
    """SGLang 0.5.22+'s schema gate (unknown sampling key): 400 {"error": "<text>"}.

    0.5.17-0.5.21 answer the same request with a bare 500 (SamplingParams(**kwargs)
    raises TypeError): the simulator does so in those modes (SimConfig.sglang_version).
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def response(self) -> web.Response:
        return json_response({"error": self.message}, status=400)


class InternalServerError(SimError):
    """An uncaught exception in SGLang (e.g. a wrong type for a sampling key)."""

    def response(self) -> web.Response:
        return web.Response(status=500, text="Internal Server Error")


class RequestValidationError(SimError):
    """FastAPI's body validation failure, turned into a 400 by SGLang's handler."""

    def __init__(self, errors: list[dict], route: tuple[int, str, str] = GENERATE_ROUTE):
        super().__init__(str(errors))
        self.errors = errors
        self.route = route

    def response(self) -> web.Response:
        count = len(self.errors)
        lines = "".join(f"\n  {error!r}" for error in self.errors)
        line, function, request_line = self.route
        trace = f'\n\n  File "{_HTTP_SERVER}", line {line}, in {function}\n    {request_line} '
        message = f"{count} validation error{'s' if count > 1 else ''}:{lines}{trace}{self.errors!r}"
        body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
        return json_response(body, status=400)


def json_response(body, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
