"""Typed errors. Handlers raise them; one middleware renders OpenAI's error body."""

from __future__ import annotations


class ProxyError(Exception):
    status = 500
    type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


class InvalidRequest(ProxyError):
    """The client's mistake (vLLM answers these with 400 BadRequestError)."""

    status = 400
    type = "BadRequestError"


class NotFound(ProxyError):
    status = 404
    type = "NotFoundError"


class BackendUnavailable(ProxyError):
    """SGLang cannot be reached (connection refused, reset)."""

    status = 503
    type = "ServiceUnavailableError"


class BackendError(ProxyError):
    """SGLang answered, but with a failure the client did not cause."""

    status = 502
    type = "BadGatewayError"


class BackendTimeout(ProxyError):
    status = 504
    type = "GatewayTimeoutError"


def context_length_error(max_model_len: int, prompt_len: int, max_tokens: int | None = None) -> InvalidRequest:
    """vLLM's wording: verifiers matches on "maximum context length"."""
    if max_tokens is None:
        return InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
            param="messages",
        )
    return InvalidRequest(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{max_tokens} output tokens and your prompt contains {prompt_len} input tokens, for a total of "
        f"{max_tokens + prompt_len} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
        "Please reduce the length of the input messages or completion.",
        param="max_tokens",
    )
