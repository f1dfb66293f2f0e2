"""What the proxy knows of SGLang, as one frozen value (pure): each server's facts (BackendInfo), and the
picture the data path uses, agreed across the servers behind an sglang-router (`agree`).

Behind a router, the servers that generate are the truth: the router's own /server_info has none of their
settings. A single SGLang is a fleet of one, agreed with itself.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from token_proxy.sglang.versions import VERIFIED_FEATURES, SGLangFeatures


@dataclass(frozen=True, slots=True)
class BackendInfo:
    served_model_name: str
    tokenizer_path: str
    max_model_len: int
    # SGLang's --incremental-streaming-output: stream events carry deltas, not everything so far.
    incremental_stream: bool
    weight_version: str | None = None
    model_path: str | None = None  # what SGLang loaded at start (what /reload_weights returns to)
    # SGLang refuses prompts of max_req_input_len tokens or more (context - 6 by default).
    max_prompt_len: int | None = None
    # SGLang reads sampling_seed only with --enable-deterministic-inference; otherwise it ignores it.
    honours_seed: bool = False
    # KV capacity (tokens) and page size: vLLM's cache_config_info as num_gpu_blocks x block_size.
    max_total_num_tokens: int | None = None
    page_size: int = 1
    # The API generation (server_info `version`): what differs between SGLang releases (sglang_api.py).
    api: SGLangFeatures = VERIFIED_FEATURES
    # --enable-metrics (server_info says; None: it does not say): the /metrics scrape needs it.
    metrics_enabled: bool | None = None


@dataclass(frozen=True, slots=True)
class Disagreement:
    """One worker differs from most workers on a fact: `line` names it and one that has the usual value
    (logged at `level`)."""

    url: str
    fact: str
    level: int
    line: str
    fatal: bool = False  # the proxy cannot serve this fleet correctly (a stream would be mis-read)


@dataclass(frozen=True, slots=True)
class SGLangPicture:
    """The backend URL (a server or a router), each generating server's facts by URL, and the agreed
    facts the data path uses. `behind_router`: the servers are not the backend URL itself."""

    backend_url: str
    workers: Mapping[str, BackendInfo]
    agreed: BackendInfo
    disagreements: tuple[Disagreement, ...] = ()

    @property
    def behind_router(self) -> bool:
        return list(self.workers) != [self.backend_url]

    @property
    def worker_urls(self) -> list[str]:
        return list(self.workers)

    def describe(self) -> str:
        """The start-up line's tail: the version and stream mode the servers themselves reported."""
        stream = "incremental streams" if self.agreed.incremental_stream else "cumulative streams"
        where = (f"{len(self.workers)} workers behind {self.backend_url}" if self.behind_router
                 else self.backend_url)
        return f"{self.agreed.api.describe()}, {stream}, from {where}"


def picture_of(backend_url: str, workers: dict[str, BackendInfo]) -> SGLangPicture:
    agreed, disagreements = agree(workers)
    return SGLangPicture(backend_url, MappingProxyType(dict(workers)), agreed, tuple(disagreements))


# (fact, BackendInfo field, level, fix) for each fact compared; the stream mode is fatal (agree's docstring).
_FACTS = (
    ("stream mode", "incremental_stream", logging.ERROR, ""),
    ("version", "version", logging.ERROR, "the proxy uses the oldest release's behaviour for all; run one release"),
    ("context length", "max_model_len", logging.INFO, "the smallest is used"),
    ("tokenizer", "tokenizer_path", logging.WARNING, ""),
    ("model", "model_path", logging.WARNING, ""),
    ("served model name", "served_model_name", logging.WARNING, ""),
    ("weight version", "weight_version", logging.WARNING, ""),
    ("seed honouring", "honours_seed", logging.WARNING, "seeds count as unhonoured"),
    ("metrics", "metrics_enabled", logging.WARNING, ""),
)


def agree(workers: dict[str, BackendInfo]) -> tuple[BackendInfo, list[Disagreement]]:
    """The facts every worker can honour, and one Disagreement per worker and fact where the worker differs
    from most workers (a tie: from the first listed). The rules keep every request valid on whichever
    worker the router picks:
    - stream mode: a fleet that disagrees cannot be served: the router picks the worker, the proxy cannot
      tell which one answered, and a stream read in the other mode is cut (deltas read as cumulative) or
      repeated (cumulative read as deltas). Fatal, naming the worker and the fix;
    - version: the oldest generation's features, sampling keys every worker accepts (an error line: a mixed
      fleet differs in aborts, weight-update sessions and error shapes);
    - context length, prompt limit and KV capacity: the smallest; a seed is honoured only if every worker
      honours it; metrics are on only if every worker has them;
    - tokenizer, model, served name, weight version: the first worker's (a warning names the one that differs).
    """
    if not workers:
        raise ValueError("agree() needs at least one worker")
    found: list[Disagreement] = []
    for fact, name, level, fix in _FACTS:
        values = {url: _fact(info, name) for url, info in workers.items()}
        usual = Counter(values.values()).most_common(1)[0][0]
        where = next(url for url, value in values.items() if value == usual)
        for url, value in values.items():
            if value == usual:
                continue
            text, fatal = fix, False
            if fact == "stream mode":
                flag = "with" if usual else "without"
                text, fatal = (f"no stream through the router can be read right: restart it {flag} "
                               "--incremental-streaming-output, like the others"), True
                value, usual_text = _mode(value), _mode(usual)
            else:
                usual_text = usual
            line = (f"SGLang worker {url} differs in {fact}: {value!r}, where {where} has {usual_text!r}"
                    f"{'; ' + text if text else ''}")
            found.append(Disagreement(url, fact, level, line, fatal))
    infos = list(workers.values())
    first = infos[0]
    oldest = min(infos, key=lambda info: info.api.assumed).api
    keys = frozenset.intersection(*(info.api.sampling_keys for info in infos))
    return replace(
        first,
        max_model_len=min(info.max_model_len for info in infos),
        max_prompt_len=_smallest(info.max_prompt_len for info in infos),
        honours_seed=all(info.honours_seed for info in infos),
        max_total_num_tokens=_smallest(info.max_total_num_tokens for info in infos),
        metrics_enabled=_all_known(info.metrics_enabled for info in infos),
        api=replace(oldest, sampling_keys=keys),
    ), found


def _fact(info: BackendInfo, name: str):
    return info.api.version if name == "version" else getattr(info, name)


def _mode(incremental: bool) -> str:
    return "incremental" if incremental else "cumulative"


def _smallest(values) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _all_known(values) -> bool | None:
    values = list(values)
    if any(v is False for v in values):
        return False
    return None if any(v is None for v in values) else True
