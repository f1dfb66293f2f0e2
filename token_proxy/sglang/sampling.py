"""SGLang's `sampling_params` keys: the one table of names, JSON types and the release that added each.

Read from the released wheels: 0.5.17's `sglang/srt/sampling/sampling_params.py` (the API fields of
SamplingParams, built with `SamplingParams(**params)`: an unknown key is a TypeError, a bare 500) and
0.5.23's wire contract `sglang/api/v1/api_types.py` (`decode_SamplingParams`: an unknown key or a
wrong type is a 400). The types are the contract's; 0.5.17 checks none of them, and a wrong one
ends in a bare 500 (shared/golden err_bad_temperature_type) or is silently misread. `null` is every
key's default in both. `sglang/versions.py` (the proxy) and `simulator/sampling_params.py` (the
stand-in) both read this table.
"""

from __future__ import annotations

from dataclasses import dataclass

INT, FLOAT, STR, BOOL = "an integer", "a number", "a string", "a boolean"
STR_OR_LIST = "a string or an array of strings"
STR_LIST = "an array of strings"
INT_LIST = "an array of integers"
FLOAT_MAP = "an object of numbers"
OBJECT = "an object"
ANY = "any JSON value"
FIRST = (0, 5, 17)


@dataclass(frozen=True, slots=True)
class SamplingKey:
    name: str
    kind: str  # one of the JSON shapes above (its text is what a refusal says)
    since: tuple[int, int, int] = FIRST
    until: tuple[int, int, int] | None = None  # the last release that accepts it (None: still accepted)

    def accepted_by(self, release: tuple[int, int, int]) -> bool:
        return self.since <= release and (self.until is None or release <= self.until)


# In SGLang's own field order (api_types.py `_FIELDS_SamplingParams`).
SAMPLING_TABLE: tuple[SamplingKey, ...] = (
    SamplingKey("max_new_tokens", INT),
    SamplingKey("stop", STR_OR_LIST),
    SamplingKey("stop_token_ids", INT_LIST),
    SamplingKey("stop_regex", STR_OR_LIST),
    *(SamplingKey(name, FLOAT) for name in ("temperature", "top_p")),
    SamplingKey("top_k", INT),
    *(SamplingKey(name, FLOAT) for name in ("min_p", "frequency_penalty", "presence_penalty",
                                            "repetition_penalty")),
    SamplingKey("min_new_tokens", INT),
    SamplingKey("n", INT),
    *(SamplingKey(name, STR) for name in ("json_schema", "regex", "ebnf", "structural_tag")),
    *(SamplingKey(name, BOOL) for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                                           "no_stop_trim")),
    SamplingKey("stream_interval", INT),
    SamplingKey("logit_bias", FLOAT_MAP),
    SamplingKey("sampling_seed", INT),
    SamplingKey("custom_params", ANY),
    SamplingKey("beam_width", INT, (0, 5, 19)),
    SamplingKey("watermark", OBJECT, (0, 5, 22)),
    SamplingKey("choice", STR_LIST, (0, 5, 23)),
    # A SamplingParams argument in 0.5.20 and 0.5.21 only: 0.5.22's wire contract does not list it
    # (bench/SGLANG_VERSIONS.md), so from there it is an unknown key like any other.
    SamplingKey("ebnf_full_assistant", BOOL, (0, 5, 20), (0, 5, 21)),
)
KIND_OF = {key.name: key.kind for key in SAMPLING_TABLE}


def keys_for(release: tuple[int, int, int]) -> tuple[str, ...]:
    """The keys a server of `release` accepts, in SGLang's order."""
    return tuple(key.name for key in SAMPLING_TABLE if key.accepted_by(release))


def has_kind(value, kind: str) -> bool:
    """`value` (not null) is of the JSON shape `kind`, as the 0.5.23 contract decodes it: booleans
    are not numbers, and an integer key takes no float (not even 4.0)."""
    if kind == INT:
        return _is_int(value)
    if kind == FLOAT:
        return _is_int(value) or isinstance(value, float)
    if kind == STR:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == STR_OR_LIST:
        return isinstance(value, str) or _list_of(value, lambda v: isinstance(v, str))
    if kind == STR_LIST:
        return _list_of(value, lambda v: isinstance(v, str))
    if kind == INT_LIST:
        return _list_of(value, _is_int)
    if kind == FLOAT_MAP:
        return isinstance(value, dict) and all(_is_int(v) or isinstance(v, float) for v in value.values())
    if kind == OBJECT:
        return isinstance(value, dict)
    return True


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _list_of(value, check) -> bool:
    return isinstance(value, list) and all(map(check, value))
