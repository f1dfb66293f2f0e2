"""SGLang's sampling_params: defaults, type rules and value checks, as 0.5.17 applies them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from token_proxy.sglang.sampling import keys_for
from token_proxy.sglang.versions import parse_version
from token_proxy.simulator.errors import BadRequest, ContractError, InternalServerError

SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30
DEFAULT_MAX_NEW_TOKENS = 128
_FLOAT_KEYS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_INT_KEYS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS  # None: up to the context length
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    stop_regex: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    stream_interval: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None
    json_schema: str | None = None  # honoured by simulator/constrained.py, as regex and ebnf
    regex: str | None = None
    ebnf: str | None = None

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @property
    def max_stop_len(self) -> int:
        return max(map(len, self.stop), default=0)


def check_known_keys(raw: dict, config) -> None:
    """An unknown key: 0.5.22+'s contract gate answers 400 naming it; before, SamplingParams(**kw)
    raises TypeError, a bare 500 (golden err_unknown_sampling_param)."""
    known = keys_for(parse_version(config.sglang_version))
    for key in raw:
        if key not in known:
            if not config.since("0.5.22"):
                raise InternalServerError(key)
            listed = ", ".join(f"`{k}`" for k in known)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")


def parse_sampling_params(raw: dict, vocab_size: int) -> SamplingParams:
    """Build and verify; a wrong type is a 500 (TypeError in SGLang), a bad value a 400."""
    _check_types(raw)
    params = _build(raw)
    _verify(params, raw, vocab_size)
    return params


def _check_types(raw: dict) -> None:
    for key in _FLOAT_KEYS:
        if raw.get(key) is not None and not _is_number(raw[key]):
            raise InternalServerError(key)
    for key in _INT_KEYS:
        if raw.get(key) is not None and not (isinstance(raw[key], int) and not isinstance(raw[key], bool)):
            raise InternalServerError(key)
    if not _is_str_or_str_list(raw.get("stop")) or not _is_str_or_str_list(raw.get("stop_regex")):
        raise InternalServerError("stop")
    stop_ids = raw.get("stop_token_ids")
    if stop_ids is not None and not (
        isinstance(stop_ids, list) and all(_is_int_or_none(t) for t in stop_ids)
    ):
        raise InternalServerError("stop_token_ids")
    bias = raw.get("logit_bias")
    if bias is not None and not (isinstance(bias, dict) and all(map(_is_number, bias.values()))):
        raise InternalServerError("logit_bias")


def _build(raw: dict) -> SamplingParams:
    values = {key: raw[key] for key in _FLOAT_KEYS + _INT_KEYS if raw.get(key) is not None}
    values["max_new_tokens"] = raw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if values.get("top_k") == -1:
        values["top_k"] = TOP_K_ALL
    if 0 <= values.get("temperature", 1.0) < SAMPLING_EPS:  # greedy, exactly as SGLang rewrites it
        values["temperature"], values["top_k"] = 1.0, 1
    for key in ("ignore_eos", "no_stop_trim"):
        values[key] = bool(raw.get(key) or False)
    values["skip_special_tokens"] = raw.get("skip_special_tokens") is not False
    values["stop"] = _as_tuple(raw.get("stop"))
    values["stop_regex"] = _as_tuple(raw.get("stop_regex"))
    values["stop_token_ids"] = frozenset(t for t in raw.get("stop_token_ids") or () if t is not None)
    values["logit_bias"] = _parse_logit_bias(raw.get("logit_bias"))
    values["stream_interval"] = raw.get("stream_interval") or 1
    for key in ("json_schema", "regex", "ebnf"):
        values[key] = raw.get(key) or None
    return SamplingParams(**values)


def _verify(p: SamplingParams, raw: dict, vocab_size: int) -> None:
    """SamplingParams.verify from SGLang 0.5.17, in its order, messages verbatim."""
    checks = _range_checks(p) + _max_new_tokens_checks(p)
    checks += [
        (0 <= t < vocab_size, f"logit_bias must has keys in [0, {vocab_size - 1}], got {t}.")
        for t in p.logit_bias
    ]
    grammars = sum(
        raw.get(key) not in (None, "") for key in ("json_schema", "regex", "ebnf", "structural_tag")
    )
    checks.append((grammars <= 1, "Only one of json_schema, regex, ebnf, or structural_tag can be set."))
    for ok, message in checks:
        if not ok:
            raise BadRequest(message)


def _range_checks(p: SamplingParams) -> list[tuple[bool, str]]:
    return [
        (
            math.isfinite(p.temperature) and p.temperature >= 0.0,
            f"temperature must be a non-negative finite number, got {p.temperature}.",
        ),
        (0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}."),
        (0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}."),
        (p.top_k >= 1, f"top_k must be -1 (disable) or at least 1, got {p.top_k}."),
        (
            -2.0 <= p.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}.",
        ),
        (
            -2.0 <= p.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {p.presence_penalty}.",
        ),
        (
            0.0 < p.repetition_penalty <= 2.0,
            f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {p.repetition_penalty}.",
        ),
        (p.min_new_tokens >= 0, f"min_new_tokens must be in [0, max_new_tokens], got {p.min_new_tokens}."),
    ]


def _max_new_tokens_checks(p: SamplingParams) -> list[tuple[bool, str]]:
    if p.max_new_tokens is None:
        return []
    return [
        (p.max_new_tokens >= 0, f"max_new_tokens must be at least 0, got {p.max_new_tokens}."),
        (
            p.min_new_tokens <= p.max_new_tokens,
            f"min_new_tokens must be in [0, max_new_tokens({p.max_new_tokens})], got {p.min_new_tokens}.",
        ),
    ]


def _parse_logit_bias(raw: dict | None) -> dict[int, float]:
    try:
        return {int(key): float(value) for key, value in (raw or {}).items()}
    except ValueError as exc:  # int("abc") inside SGLang's verify: an uncaught ValueError... is a 400
        raise BadRequest(str(exc)) from exc


def _as_tuple(value) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int_or_none(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _is_str_or_str_list(value) -> bool:
    return (
        value is None
        or isinstance(value, str)
        or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    )
