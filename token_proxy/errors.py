"""Typed errors. Handlers raise them; one middleware renders OpenAI's error body."""

from __future__ import annotations


def error_body(message: str, err_type: str, param: str | None, status: int) -> dict:
    """OpenAI's error body; every error the proxy writes (JSON or in a stream) is built here."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


class ProxyError(Exception):
    status = 500
    type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.status)

    def headers(self) -> dict | None:
        return None


class InvalidRequest(ProxyError):
    """The client's mistake (vLLM answers these with 400 BadRequestError)."""

    status = 400
    type = "BadRequestError"


class NotFound(ProxyError):
    status = 404
    type = "NotFoundError"


class MethodNotAllowed(ProxyError):
    status = 405
    type = "MethodNotAllowedError"

    def __init__(self, method: str, path: str, allowed: tuple[str, ...]):
        super().__init__(f"Method {method} is not allowed on {path}; use {', '.join(allowed)}")
        self.allowed = allowed

    def headers(self) -> dict:
        return {"Allow": ", ".join(self.allowed)}


class NotImplementedHere(ProxyError):
    """A route vLLM or a trainer knows that the proxy cannot serve in front of SGLang (the message says why
    and what to use instead)."""

    status = 501
    type = "NotImplementedError"


class BackendUnavailable(ProxyError):
    """SGLang cannot be reached (connection refused, reset, restarting): retrying helps."""

    status = 503
    type = "ServiceUnavailableError"

    def headers(self) -> dict:
        return {"Retry-After": "1"}


class ReplyBrokeOff(BackendUnavailable):
    """SGLang's answer began, then its connection closed mid-body: the server generating it died (a worker
    killed behind sglang-router). Before any byte of it reached the client, it may be generated again
    (sglang/retry_rules.py)."""


class BackendError(ProxyError):
    """SGLang answered, but with a failure the client did not cause."""

    status = 502
    type = "BadGatewayError"


class BackendTimeout(ProxyError):
    status = 504
    type = "GatewayTimeoutError"


def prompt_too_long(max_model_len: int, prompt_len: int, max_prompt_len: int | None = None) -> InvalidRequest:
    """vLLM's wording (verifiers matches on "maximum context length")."""
    if max_prompt_len is None or prompt_len > max_model_len:
        limit = "this limit even without any output tokens"
    else:  # SGLang keeps a few tokens of the context back from the prompt (max_req_input_len)
        limit = f"the engine's limit of {max_prompt_len} input tokens"
    return InvalidRequest(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{prompt_len} input tokens, which exceeds {limit}. Please reduce the length of the input prompt.",
        param="input_tokens",
    )


def max_tokens_too_large(param: str, max_tokens: int, max_model_len: int) -> InvalidRequest:
    return InvalidRequest(
        f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
        "Please request fewer output tokens.",
        param=param,
    )
