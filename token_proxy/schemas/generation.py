"""SGLang's /generate outputs, normalised, and the finish-reason mapping every endpoint shares."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Generation:
    """One finished choice as SGLang reported it."""

    index: int
    text: str
    token_ids: list[int]
    finish: dict | None
    meta: dict

    @property
    def completion_tokens(self) -> int:
        return self.meta.get("completion_tokens", len(self.token_ids))

    @property
    def cached_tokens(self) -> int:
        return self.meta.get("cached_tokens") or 0

    @property
    def weight_version(self) -> str | None:
        return self.meta.get("weight_version")


def generations(raw: list[dict]) -> list[Generation]:
    return [
        Generation(index=item.get("index", i), text=item.get("text") or "",
                   token_ids=list(item.get("output_ids") or []),
                   finish=(item.get("meta_info") or {}).get("finish_reason"), meta=item.get("meta_info") or {})
        for i, item in enumerate(raw)
    ]


def cut_at_stop_ids(gen: Generation, stop_ids: frozenset[int], decode) -> Generation:
    """End `gen` at its first token in `stop_ids`, as vLLM would have stopped there.

    Used when the client asks for ignore_eos and stop_token_ids together: SGLang then runs
    with ignore_eos alone (which would disable its stop ids) and the proxy stops instead.
    `decode(ids)` gives the text of the kept tokens; the stop token's own text is dropped,
    as vLLM drops it.
    """
    cut = next((i for i, t in enumerate(gen.token_ids) if t in stop_ids), None)
    if cut is None:
        return gen
    meta = dict(gen.meta, completion_tokens=cut + 1)
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if meta.get(key) is not None:
            meta[key] = meta[key][: cut + 1]
    ids = gen.token_ids[: cut + 1]
    return Generation(gen.index, decode(ids[:-1]), ids, {"type": "stop", "matched": ids[-1]}, meta)


def map_finish(finish: dict | None, eos_token_id: int | None) -> tuple[str | None, int | str | None]:
    """SGLang's finish_reason -> vLLM's (finish_reason, stop_reason).

    The tokenizer's EOS -> ("stop", None); any other stop id (a requested one, or an
    extra EOS from generation_config, which vLLM adds to stop_token_ids) -> ("stop", id);
    a stop string -> ("stop", string); max tokens or the context end -> ("length", None).
    Pass eos_token_id=None under ignore_eos: vLLM then reports every stop id.
    """
    if not finish:
        return None, None
    kind = finish.get("type")
    if kind == "stop":
        matched = finish.get("matched")
        if isinstance(matched, bool) or matched is None or matched == eos_token_id:
            return "stop", None
        return "stop", matched
    if kind == "length":
        return "length", None
    if kind == "abort":
        return "abort", None
    return str(kind), None
