"""vLLM's `weight_versions` (WeightVersionSpan: output tokens [start, end) were sampled by weights
labelled `version`) from the weight_version SGLang reports in each reply's meta_info.

A stream sees the version of every event, so a choice that spans a weight update gets one span
per version, split where the version changed. A non-streaming reply carries only the version
SGLang reported when it finished; its single span covers the whole output (the output rules
see it as one event).
"""

from __future__ import annotations


def span(version: str, start: int, end: int) -> dict:
    return {"version": version, "start": start, "end": end}


class VersionSpans:
    """Per choice: where each version started producing tokens (vLLM's track_weight_version)."""

    def __init__(self) -> None:
        self._starts: dict[int, list[tuple[str, int]]] = {}
        self._last: dict[int, object] = {}  # per choice, the version as last tracked (most events repeat it)

    def track(self, index: int, version: str | None, tokens_before: int, new_tokens: int) -> None:
        if version is None or not new_tokens or self._last.get(index) == version:
            return
        self._last[index] = version
        starts = self._starts.setdefault(index, [])
        if not starts or starts[-1][0] != str(version):
            starts.append((str(version), tokens_before))

    def spans(self, index: int, num_tokens: int, reported=None) -> list[dict] | None:
        """SGLang 0.5.19+ reports exact spans on a finished reply (`reported`): those win, cut to
        `num_tokens` (the proxy may end a choice early at a stop id)."""
        if isinstance(reported, list) and reported and all(isinstance(s, dict) for s in reported):
            return [span(str(s.get("version")), s.get("start", 0), min(s.get("end", num_tokens), num_tokens))
                    for s in reported if s.get("start", 0) < num_tokens or s.get("start", 0) == 0]
        starts = self._starts.get(index)
        if not starts:
            return None
        ends = [start for _, start in starts[1:]] + [num_tokens]
        return [span(version, start, end) for (version, start), end in zip(starts, ends)]
