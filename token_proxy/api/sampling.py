"""vLLM/OpenAI sampling fields: validated into one SamplingRequest (the shared vocabulary's,
token_proxy/vocabulary.py: the pipeline and the SGLang payload read it), shared by every endpoint."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from token_proxy.api.fields import (
    bad,
    opt_bool,
    opt_dict,
    opt_float,
    opt_int,
    token_id_list,
)
from token_proxy.errors import InvalidRequest
from token_proxy.vocabulary import SamplingRequest

MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_STOP_STRINGS = 32  # SGLang's limit
MAX_N = 1024  # samples per request (the native pass-through keeps to it too: admin/native_checks.py)


@dataclass(frozen=True, slots=True)
class Range:
    """A numeric field's bounds (None: the int64 bound for integers, none for numbers)."""

    lo: float | None = None
    hi: float | None = None
    exclusive_lo: bool = False  # lo itself is refused
    integer: bool = False


# The one copy of the sampling fields' ranges: parse_sampling enforces them, GET /openapi.json
# (ops/openapi.py) describes them.
RANGES = {
    "n": Range(1, MAX_N, integer=True),
    "max_tokens": Range(1, integer=True),  # the top is the context length, known once SGLang is
    "min_tokens": Range(0, integer=True),  # the top is max_tokens
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, exclusive_lo=True),
    "top_k": Range(-1, integer=True),
    "min_p": Range(0.0, 1.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "presence_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 2.0, exclusive_lo=True),
    "seed": Range(-(2**63), 2**64 - 1, integer=True),
    "top_logprobs": Range(0, MAX_TOP_LOGPROBS, integer=True),  # chat's; completions' `logprobs` count too
    "prompt_logprobs": Range(0, MAX_TOP_LOGPROBS, integer=True),
    "best_of": Range(1, integer=True),
    "stream_interval": Range(1, integer=True),
}


def _int(body: dict, key: str, default: int | None = None, *, bounds: str | None = None,
         hi: int | None = None) -> int | None:
    """`key` read as an integer in RANGES[bounds or key]; `hi` narrows the top (min_tokens <= max_tokens)."""
    if body.get(key) is None:  # absent, as most of a body's ~25 sampling fields are: opt_int's default
        return default
    r = RANGES[bounds or key]
    return opt_int(body, key, default, lo=r.lo, hi=r.hi if hi is None else hi)


def _float(body: dict, key: str) -> float | None:
    if body.get(key) is None:  # absent: opt_float's default
        return None
    r = RANGES[key]
    value = opt_float(body, key, lo=None if r.exclusive_lo else r.lo, hi=r.hi)
    if value is not None and r.exclusive_lo and value <= r.lo:
        raise bad(key, f"must be in ({r.lo:g}, {r.hi:g}], got {value}" if key == "top_p" else
                  f"must be > {r.lo:g}, got {value}")
    return value


def parse_sampling(body: dict, vocab_size: int, *, logprobs_count: bool = False) -> SamplingRequest:
    """Read the sampling fields of a chat/completions/generate body; refuse what SGLang cannot honour.

    Chat has `logprobs: bool` + `top_logprobs: int`; completions and vLLM's SamplingParams
    have `logprobs: int` (the number of top alternatives), which `logprobs_count` selects.
    """
    _refuse_unsupported(body)
    logprobs, top_logprobs = _parse_logprob_count(body) if logprobs_count else _parse_chat_logprobs(body)
    max_tokens = _int(body, _max_tokens_key(body), bounds="max_tokens")
    return SamplingRequest(
        n=_int(body, "n", 1),
        max_tokens=max_tokens,
        max_tokens_param=_max_tokens_key(body),
        min_tokens=_int(body, "min_tokens", 0, hi=max_tokens),
        temperature=_float(body, "temperature"),
        top_p=_float(body, "top_p"),
        top_k=_parse_top_k(body),
        min_p=_float(body, "min_p"),
        frequency_penalty=_float(body, "frequency_penalty"),
        presence_penalty=_float(body, "presence_penalty"),
        repetition_penalty=_float(body, "repetition_penalty"),
        stop=_parse_stop(body),
        stop_token_ids=tuple(() if body.get("stop_token_ids") is None else token_id_list(
            body["stop_token_ids"], "stop_token_ids", vocab_size, allow_empty=True)),
        include_stop_str_in_output=opt_bool(body, "include_stop_str_in_output", False),
        ignore_eos=opt_bool(body, "ignore_eos", False),
        seed=_int(body, "seed"),
        logit_bias=_parse_logit_bias(body, vocab_size),
        skip_special_tokens=opt_bool(body, "skip_special_tokens", True),
        spaces_between_special_tokens=opt_bool(body, "spaces_between_special_tokens", True),
        constraint=_parse_constraint(body),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=_int(body, "prompt_logprobs"),
        stream_interval=_int(body, "stream_interval"),
    )


def _refuse_unsupported(body: dict) -> None:
    if body.get("use_beam_search"):
        raise bad("use_beam_search", "beam search is not supported by the SGLang backend")
    if _int(body, "best_of", 1) != 1:
        raise bad("best_of", "best_of > 1 is not supported (use n)")
    for key in ("bad_words", "allowed_token_ids", "logits_processors"):
        if body.get(key):
            raise bad(key, "is not supported by the SGLang backend")


def _max_tokens_key(body: dict) -> str:
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def _parse_top_k(body: dict) -> int | None:
    top_k = _int(body, "top_k")
    return -1 if top_k == 0 else top_k  # vLLM: 0 and -1 both mean "off"; SGLang only knows -1


def _parse_stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop", "must be a string or an array of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
    if any(s == "" for s in stop):
        raise bad("stop", "stop strings must not be empty")
    return tuple(stop)


def _parse_logit_bias(body: dict, vocab_size: int) -> dict | None:
    bias = opt_dict(body, "logit_bias")
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):  # as /openapi.json's pattern: no sign, space or other digits
            raise bad("logit_bias", f"key {key!r} is not a token id")
        token = int(key)
        if not 0 <= token < vocab_size:
            raise bad("logit_bias", f"token id {token} is out of range [0, {vocab_size})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("logit_bias", f"bias for token {token} must be a number")
        out[str(token)] = max(-100.0, min(100.0, float(value)))  # OpenAI's range, clamped as vLLM does
    return out


def _parse_chat_logprobs(body: dict) -> tuple[bool, int]:
    logprobs = opt_bool(body, "logprobs", False)
    top = _int(body, "top_logprobs")
    if top is not None and top > 0 and not logprobs:
        raise bad("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true")
    return logprobs, top or 0


def _parse_logprob_count(body: dict) -> tuple[bool, int]:
    count = _int(body, "logprobs", bounds="top_logprobs")
    return count is not None, count or 0


def _parse_constraint(body: dict) -> tuple[str, str] | None:
    if body.get("response_format") is None and body.get("structured_outputs") is None:
        return None  # what both readers below make of two absent fields
    fmt = opt_dict(body, "response_format")
    from_format = None if fmt is None else _constraint_from_response_format(fmt)
    from_structured = _constraint_from_structured(opt_dict(body, "structured_outputs") or {})
    if from_format and from_structured:
        raise bad("structured_outputs", "give response_format or structured_outputs, not both")
    return from_format or from_structured


# vLLM's StructuredOutputsParams field -> SGLang's constraint key (render.py reads it the other way).
STRUCTURED_TO_SGLANG = {"json": "json_schema", "regex": "regex", "grammar": "ebnf"}


def _constraint_from_structured(structured: dict) -> tuple[str, str] | None:
    for src in ("regex", "grammar"):  # vLLM's StructuredOutputsParams: str | None, dict too for json
        if structured.get(src) is not None and not isinstance(structured[src], str):
            raise bad("structured_outputs", f"structured_outputs.{src} must be a string")
    if structured.get("json") is not None and not isinstance(structured["json"], (str, dict)):
        raise bad("structured_outputs", "structured_outputs.json must be a JSON schema (an object or a string)")
    given = [k for k in ("json", "regex", "grammar", "choice") if structured.get(k) not in (None, [])]
    if len(given) > 1:  # as vLLM: a second constraint would be silently ignored
        raise bad("structured_outputs", f"only one kind of constraint may be given, got {', '.join(given)}")
    for src, dst in STRUCTURED_TO_SGLANG.items():
        value = structured.get(src)
        if value is not None:
            return dst, value if isinstance(value, str) else orjson.dumps(value).decode()
    choice = structured.get("choice")
    if choice is not None and not isinstance(choice, list):
        raise bad("structured_outputs", "structured_outputs.choice must be a list of strings")
    if choice:
        return "regex", "(" + "|".join(_regex_escape(c) for c in choice) + ")"
    return None


def _constraint_from_response_format(fmt: dict) -> tuple[str, str] | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad("response_format", "json_schema.schema must be an object")
        return "json_schema", orjson.dumps(spec.get("schema", {})).decode()
    if kind == "structural_tag":
        return "structural_tag", orjson.dumps({k: v for k, v in fmt.items() if k != "type"}).decode()
    raise bad("response_format", f"unsupported type {kind!r}")


def _regex_escape(choice) -> str:
    import re

    if not isinstance(choice, str):
        raise InvalidRequest("structured_outputs.choice must be a list of strings", param="structured_outputs")
    return re.escape(choice)

