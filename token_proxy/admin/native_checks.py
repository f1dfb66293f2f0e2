"""What the pass-through refuses before SGLang sees it: the inputs that crash or wedge the engine.

SGLang checks no prompt id against its vocabulary (0.5.17 to 0.5.23; upstream PRs #31908, #8383 are
open): an id past the embedding table is a CUDA device-side assert that ends the server for every
client (shared/golden throughput.json). Ids in `token_ids_logprob` or `/v1/score`'s
`label_token_ids` index the logprobs the same way; a `top_logprobs_num` past the vocabulary is a
`topk` error in the scheduler process. A wrong type in `sampling_params` is SGLang 0.5.17's bare 500.
So the native routes that carry ids or sampling parameters are checked here with the proxy's own
rules (`api/fields.token_id_list`, the key table `sglang/sampling.py`), and a refusal is
SGLang's own 400 body, `{"error": {"message": ...}}` (http_server.py `_create_error_response`), since
these clients speak SGLang. Everything else (an empty prompt, a bad range SGLang's `verify` reports
as a 400 itself) is left to SGLang, so its replies stay its own, byte for byte. Pure functions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from token_proxy import checks as check
from token_proxy.api.fields import INT64_MAX, INT64_MIN, token_id_list, type_name
from token_proxy.api.sampling import MAX_N
from token_proxy.errors import InvalidRequest
from token_proxy.sglang.sampling import FLOAT, FLOAT_MAP, INT, INT_LIST, KIND_OF, has_kind

FLOAT32_MAX = 3.4028234663852886e38  # SGLang puts logit_bias in a float32 tensor: past this it is inf


class SGLangRefusal(InvalidRequest):
    """A 400 in SGLang's own shape for a bad /generate (not OpenAI's: native clients read SGLang's)."""

    def body(self) -> dict:
        return {"error": {"message": self.message}}


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int  # the tokenizer's (what the proxy's own routes check ids against)
    sampling_keys: frozenset[str]  # the running SGLang version's (SGLangFeatures.sampling_keys)


def parse_body(raw: bytes):
    """The body as SGLang reads it: Starlette's `json.loads`, which also takes NaN, Infinity, UTF-16
    and integers past 64 bits (orjson reads those as floats, or not at all). None when it is not JSON:
    SGLang's own 400."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def check_native(path: str, raw: bytes, limits: Limits) -> None:
    """Refuse (SGLangRefusal) a body for `path` that would harm SGLang; anything else passes."""
    checker = CHECKS.get(path)
    if checker is None or not raw:
        return
    body = parse_body(raw)
    if not isinstance(body, dict):
        return  # not a JSON object: SGLang's own validation answers 400
    try:
        checker(body, limits)
    except InvalidRequest as refusal:
        raise SGLangRefusal(refusal.message, param=refusal.param) from None


def needs_check(path: str) -> bool:
    return path in CHECKS


# --- per route ---------------------------------------------------------------------------------

def check_generate(body: dict, limits: Limits) -> None:
    """POST /generate (GenerateReqInput): one prompt or a batch, by ids or text."""
    ids_or_batch(body.get("input_ids"), "input_ids", limits.vocab_size)
    ids_or_batch(body.get("token_ids_logprob"), "token_ids_logprob", limits.vocab_size)
    one_or_list(body.get("top_logprobs_num"), "top_logprobs_num",
                lambda value, param: bounded_int(value, param, 0, limits.vocab_size))
    one_or_list(body.get("sampling_params"), "sampling_params",
                lambda value, param: sampling_params(value, param, limits.sampling_keys))


def check_input_ids(body: dict, limits: Limits) -> None:
    """/encode, /classify (EmbeddingReqInput): ids run through the embedding table too."""
    ids_or_batch(body.get("input_ids"), "input_ids", limits.vocab_size)


def check_embeddings(body: dict, limits: Limits) -> None:
    """/v1/embeddings: `input` may be ids ([1, 2] or [[1, 2], [3]]) as well as text."""
    value = body.get("input")
    if isinstance(value, list) and value and not any(isinstance(item, (str, dict)) for item in value):
        ids_or_batch(value, "input", limits.vocab_size)


def check_score(body: dict, limits: Limits) -> None:
    """/v1/score: `query` and `items` may be ids; `label_token_ids` index the logprobs."""
    if isinstance(body.get("query"), list):
        token_id_list(body["query"], "query", limits.vocab_size, allow_empty=True)
    items = body.get("items")
    if isinstance(items, list) and items and not any(isinstance(item, str) for item in items):
        ids_or_batch(items, "items", limits.vocab_size)
    if body.get("label_token_ids") is not None:
        token_id_list(body["label_token_ids"], "label_token_ids", limits.vocab_size, allow_empty=True)


def check_vertex(body: dict, limits: Limits) -> None:
    """/vertex_generate: `instances[i].input_ids` and `parameters` become a /generate call."""
    instances = body.get("instances")
    for i, instance in enumerate(instances if isinstance(instances, list) else ()):
        if isinstance(instance, dict):
            ids_or_batch(instance.get("input_ids"), f"instances[{i}].input_ids", limits.vocab_size)
    sampling_params(body.get("parameters"), "parameters", limits.sampling_keys)


def check_send_group(body: dict, limits: Limits) -> None:
    """/init_weights_send_group_for_remote_instance: the same rendezvous as /init_weights_update_group
    (a port or rank no peer will meet blocks the scheduler); `ports` is a comma-separated string."""
    check.host(body.get("master_address"), "master_address")
    ports = body.get("ports")
    if not isinstance(ports, str) or not ports.strip():
        raise InvalidRequest(f"ports: must be comma-separated ports, got {ports!r}", param="ports")
    for port in ports.split(","):
        check.port(int(port) if port.strip().isdigit() else port, "ports")
    world_size = check.integer(body.get("world_size"), "world_size", 2)
    rank = check.integer(body.get("group_rank"), "group_rank", 0)
    if rank >= world_size:
        raise InvalidRequest(f"group_rank {rank} must be < world_size {world_size}", param="group_rank")
    check.backend(body.get("backend", "nccl"))


CHECKS: dict[str, Callable[[dict, Limits], None]] = {
    "/generate": check_generate,
    "/encode": check_input_ids,
    "/classify": check_input_ids,
    "/v1/embeddings": check_embeddings,
    "/v1/score": check_score,
    "/vertex_generate": check_vertex,
    "/init_weights_send_group_for_remote_instance": check_send_group,
}


# --- the pieces --------------------------------------------------------------------------------

def ids_or_batch(value, param: str, vocab_size: int) -> None:
    """One prompt's ids, or a batch of them; every id in [0, vocab_size). Empty is SGLang's to refuse."""
    if value is None:
        return
    if isinstance(value, list) and value and isinstance(value[0], list):
        for i, ids in enumerate(value):
            token_id_list(ids, f"{param}[{i}]", vocab_size, allow_empty=True)
    else:
        token_id_list(value, param, vocab_size, allow_empty=True)


def one_or_list(value, param: str, check: Callable[[object, str], None]) -> None:
    """A per-request field: one value for every prompt, or one per prompt."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            check(item, f"{param}[{i}]")
    elif value is not None:
        check(value, param)


def bounded_int(value, param: str, lo: int, hi: int) -> None:
    if value is None:
        return
    if not has_kind(value, INT):
        raise InvalidRequest(f"{param}: must be an integer, got {type_name(value)}", param=param)
    if not lo <= value <= hi:
        raise InvalidRequest(f"{param}: must be in [{lo}, {hi}], got {value}", param=param)


def sampling_params(params, param: str, keys: frozenset[str]) -> None:
    """Keys the running version knows, each of its JSON type (sglang/sampling.py), integers
    within int64, numbers finite, n within the proxy's own bound. Value ranges SGLang checks itself."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise InvalidRequest(f"{param}: must be an object, got {type_name(params)}", param=param)
    for key, value in params.items():
        name = f"{param}.{key}"
        if key not in keys:
            known = ", ".join(f"`{k}`" for k in KIND_OF if k in keys)
            raise InvalidRequest(f"{param}: unknown field `{key}`, expected one of {known}", param=name)
        if value is None:
            continue
        kind = KIND_OF[key]
        if not has_kind(value, kind):
            raise InvalidRequest(f"{name}: must be {kind}, got {type_name(value)}", param=name)
        for number in _numbers(value, kind):
            _check_number(number, name, key)


def _numbers(value, kind: str) -> list:
    if kind in (INT, FLOAT):
        return [value]
    if kind == INT_LIST:
        return value
    if kind == FLOAT_MAP:
        return list(value.values())
    return []


def _check_number(number, name: str, key: str) -> None:
    if isinstance(number, int):
        if not INT64_MIN <= number <= INT64_MAX:  # SGLang 0.5.21+'s sampling_seed rule, for every int
            raise InvalidRequest(f"{name}: must be in [-2**63, 2**63 - 1], got {number}", param=name)
        if key == "n" and not 1 <= number <= MAX_N:
            raise InvalidRequest(f"{name}: must be in [1, {MAX_N}], got {number}", param=name)
    elif not math.isfinite(number) or (key == "logit_bias" and abs(number) > FLOAT32_MAX):
        raise InvalidRequest(f"{name}: must be a finite number, got {number}", param=name)
