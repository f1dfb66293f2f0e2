"""Small typed readers for JSON request fields: each names the offending parameter on failure; and the
output options (stream, stream_options, token-id extras) that chat and completions both read.

JSON booleans are not integers here (Python says `True` is an int; OpenAI's schema does not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from token_proxy.errors import InvalidRequest
from token_proxy.ids import checked_id

# Integers go to SGLang as JSON; past 64 bits the proxy could not even encode them.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# An integer-valued float (7.0) reads as that integer while it is exact; past 2**53 JSON's reader has
# rounded it (-2**63 - 1 arrives as -2**63), so it is refused rather than taken as a neighbour.
EXACT_FLOAT_INT = 2**53


def bad(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param)


def opt_bool(body: dict, key: str, default: bool | None = None) -> bool | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(key, f"must be a boolean, got {type_name(value)}")
    return value


def opt_int(body: dict, key: str, default: int | None = None, *, lo: int | None = None,
            hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and abs(value) <= EXACT_FLOAT_INT:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, f"must be an integer, got {type_name(value)}")
    _check_range(key, value, INT64_MIN if lo is None else lo, INT64_MAX if hi is None else hi)
    return value


def opt_float(body: dict, key: str, default: float | None = None, *, lo: float | None = None,
              hi: float | None = None) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(key, f"must be a number, got {type_name(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise bad(key, "must be a finite number")
    _check_range(key, value, lo, hi)
    return value


def opt_str(body: dict, key: str, default: str | None = None) -> str | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad(key, f"must be a string, got {type_name(value)}")
    return value


def opt_request_id(body: dict, key: str = "request_id") -> str | None:
    """A client-chosen id: it is sent back as a header, so control characters would break the response."""
    value = opt_str(body, key)
    return None if value is None else checked_id(value, key)


def opt_dict(body: dict, key: str) -> dict | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad(key, f"must be an object, got {type_name(value)}")
    return value


def opt_list(body: dict, key: str) -> list | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad(key, f"must be an array, got {type_name(value)}")
    return value


def token_id_list(value: Any, param: str, vocab_size: int, *, allow_empty: bool = False) -> list[int]:
    """A list of token ids, each in 0..vocab_size-1 (an id past the vocabulary crashes SGLang)."""
    if not isinstance(value, list):
        raise bad(param, f"must be an array of token ids, got {type_name(value)}")
    if not value and not allow_empty:
        raise bad(param, "must not be empty")
    return value if plain_ids(value, vocab_size) else checked_ids(value, param, vocab_size)


def plain_ids(value: list, vocab_size: int) -> bool:
    """The common case, checked in C (~0.05 us an id, against ~0.25 for the loop of checked_ids): every
    item a plain int (bool is a type of its own) in [0, vocab_size). Then checked_ids changes nothing."""
    return not value or (set(map(type, value)) == _JUST_INT and min(value) >= 0 and max(value) < vocab_size)


def checked_ids(value: list, param: str, vocab_size: int) -> list[int]:
    """Each item checked in turn: 7.0 becomes 7 (in place), the first bad item is named."""
    for i, token in enumerate(value):
        if isinstance(token, float) and token.is_integer():  # 7.0: an integer in JSON, as for opt_int
            value[i] = token = int(token)
        if isinstance(token, bool) or not isinstance(token, int):
            raise bad(param, f"item {i} must be an integer token id, got {type_name(token)}")
        if not 0 <= token < vocab_size:
            raise bad(param, f"item {i} ({token}) is out of range: token ids must be in [0, {vocab_size})")
    return value


_JUST_INT = {int}


def _check_range(key: str, value, lo, hi) -> None:
    if lo is not None and value < lo:
        raise bad(key, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad(key, f"must be <= {hi}, got {value}")


def type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """What the client asked to see in the answer (all vLLM extras)."""

    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False


def parse_output_options(body: dict) -> OutputOptions:
    stream = opt_bool(body, "stream", False)
    options = opt_dict(body, "stream_options")
    if options is not None and not stream:
        raise bad("stream_options", "Stream options can only be defined when `stream=True`.")
    options = options or {}
    return OutputOptions(
        stream=stream,
        include_usage=opt_bool(options, "include_usage", False),
        continuous_usage_stats=opt_bool(options, "continuous_usage_stats", False),
        return_token_ids=opt_bool(body, "return_token_ids", False),
        return_tokens_as_token_ids=opt_bool(body, "return_tokens_as_token_ids", False),
    )
