"""Typed checks of JSON bodies and queries (admin routes, LoRA loads, the CLI's true/false words): refuse
requests that would hurt the engine before they reach SGLang.

A real SGLang server blocks its scheduler indefinitely on an /init_weights_update_group with a
port or rank that no trainer will ever meet, and treats a weight path that does not exist as a
Hugging Face Hub id to download (../shared/gpu/README.md). These checks are pure functions.
"""

from __future__ import annotations

from pathlib import Path

from token_proxy.errors import InvalidRequest

TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def bool_word(value: str) -> bool | None:
    """A true/false word of a flag or query parameter (any case); None when it is neither."""
    word = value.lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


BACKENDS = ("nccl", "gloo")
# torch dtype names SGLang's receiver resolves with getattr(torch, name).
DTYPES = frozenset({
    "float32", "float", "float16", "half", "bfloat16", "float64", "double", "int8", "uint8", "int16",
    "int32", "int", "int64", "long", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz",
})


def query_flag(query, name: str, default: bool) -> bool:
    """A true/false query parameter (true/1/yes/on, false/0/no/off, any case); anything else is a 400."""
    value = query.get(name)
    if value is None:
        return default
    flag = bool_word(value)
    if flag is not None:
        return flag
    raise InvalidRequest(f"{name} must be true or false, got {value!r}", param=name)


def port(value, param: str) -> int:
    # Port 0 never errors: torch waits for a master that does not exist (golden/extra_run3).
    if not _is_int(value) or not 1 <= value <= 65535:
        raise InvalidRequest(f"{param} must be an integer port in 1..65535, got {value!r}", param=param)
    return value


def host(value, param: str) -> str:
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
        raise InvalidRequest(f"{param} must be a host name or address, got {value!r}", param=param)
    return value


def seconds(value, param: str, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
        raise InvalidRequest(f"{param} must be a number of seconds in (0, 86400], got {value!r}", param=param)
    return float(value)


def integer(value, param: str, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        raise InvalidRequest(f"{param} must be an integer >= {minimum}, got {value!r}", param=param)
    return value


def text(value, param: str, default: str | None = None) -> str:
    if value is None and default is not None:
        return default
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param} must be a non-empty string, got {value!r}", param=param)
    return value


def backend(value) -> str:
    if value not in BACKENDS:
        raise InvalidRequest(f"backend must be one of {', '.join(BACKENDS)}, got {value!r}", param="backend")
    return value


def rank_layout(first_offset: int, tp_sizes: list[int], world_size: int) -> list[int]:
    """Each worker's rank_offset: SGLang ranks are rank_offset + tp_rank, the trainer is rank 0, and
    every rank must be < world_size — or the group never completes and SGLang's scheduler waits."""
    if first_offset < 1:
        raise InvalidRequest(f"rank_offset must be >= 1 (rank 0 is the trainer), got {first_offset}",
                             param="rank_offset")
    offsets, next_rank = [], first_offset
    for size in tp_sizes:
        offsets.append(next_rank)
        next_rank += size
    if next_rank > world_size:
        raise InvalidRequest(
            f"world_size {world_size} is too small: the trainer (rank 0) and {sum(tp_sizes)} inference "
            f"rank(s) starting at rank {first_offset} need at least {next_rank}", param="world_size")
    return offsets


def tensor_specs(body: dict) -> None:
    """names / dtypes / shapes of /update_weights_from_distributed: same length, real dtypes, shapes
    of non-negative ints. A malformed announcement desynchronises the broadcast."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    for key, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(value, list) or not value:
            raise InvalidRequest(f"{key} must be a non-empty list", param=key)
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidRequest(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
                             f"{len(shapes)})", param="shapes")
    for dtype in dtypes:
        if str(dtype).removeprefix("torch.") not in DTYPES:
            raise InvalidRequest(f"unknown dtype {dtype!r}", param="dtypes")
    for name, shape in zip(names, shapes):
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise InvalidRequest(f"the shape of {name!r} must be a list of non-negative ints, got {shape!r}",
                                 param="shapes")


def looks_local(path: str) -> bool:
    """A Hub id is `name` or `org/name`; anything absolute, relative-dotted or deeper is a path."""
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or "\\" in path


# Linux's NAME_MAX and PATH_MAX (bytes): a longer name is no directory anywhere (the OS refuses it with
# ENAMETOOLONG, which pathlib's is_dir / exists raise) and no Hugging Face Hub id either.
NAME_MAX, PATH_MAX = 255, 4095


def path(value, param: str) -> str:
    """A non-empty path string whose every name fits the file system: a 400 here, never an OSError later."""
    given = text(value, param)
    encoded = given.encode("utf-8", "surrogatepass")
    longest = max(len(name) for name in encoded.split(b"/"))
    if len(encoded) > PATH_MAX or longest > NAME_MAX or "\0" in given:
        raise InvalidRequest(f"{param} is not a usable path: at most {PATH_MAX} bytes, each name at most {NAME_MAX} "
                             f"bytes, no NUL (got {len(encoded)} bytes, longest name {longest})", param=param)
    return given


def local_dir(value, param: str, settings) -> str:
    """A weight or adapter path, checked against the operator's policy before SGLang sees it: it must
    exist when it looks local (else SGLang tries it as a Hub id), and with --weight-dir roots set it
    must lie inside one of them, with no `..` and no symlink leading out."""
    given = path(value, param)
    if looks_local(given) and settings.weight_dirs:
        inside_roots(given, param, settings.weight_dirs)
    elif settings.weight_dirs:
        raise InvalidRequest(f"{param} must be a path under the allowed weight directories, not a hub id",
                             param=param)
    if settings.check_local_paths and looks_local(given) and not Path(given).expanduser().is_dir():
        raise InvalidRequest(
            f"{param} {given!r} is not an existing directory here; refused before SGLang, which would "
            "try it as a Hugging Face Hub id", param=param)
    return given


def inside_roots(path: str, param: str, roots) -> None:
    if ".." in Path(path).parts:
        raise InvalidRequest(f"{param} must not contain '..'", param=param)
    resolved = Path(path).expanduser().resolve()  # follows symlinks: a link out of a root is refused
    for root in roots:
        if resolved.is_relative_to(Path(root).expanduser().resolve()):
            return
    raise InvalidRequest(f"{param} is outside the allowed weight directories", param=param)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
