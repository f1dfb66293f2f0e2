"""The JSON SGLang sends for a sequence: a final reply, or one stream event.

Key order follows the golden recordings, since clients that diff or log
replies see it: timing keys come after dp_rank, and response_sent_to_client_ts
sits last until the first event of a stream has been sent.
"""

from __future__ import annotations

import time

from token_proxy.simulator.sequence import Sequence


def final_payload(seq: Sequence, weight_version: str) -> dict:
    meta = _meta_info(seq, weight_version, final=True)
    _finish_times(meta, seq)
    _weight_versions(meta, seq)
    return _with_extras(
        {"text": seq.final_text(), "output_ids": list(seq.output_ids), "meta_info": meta}, seq
    )


def stream_event(seq: Sequence, weight_version: str, incremental: bool, with_index: bool) -> dict:
    final = seq.finished
    text = seq.final_text() if final else seq.committed_text
    output_from = seq.sent_ids if incremental else 0
    meta = _meta_info(seq, weight_version, final=final, output_from=output_from)
    if final:
        _finish_times(meta, seq)
        _weight_versions(meta, seq)
    elif not seq.timing.first_sent:
        seq.timing.first_sent = meta["response_sent_to_client_ts"] = time.time()
    event = {
        "text": text[seq.sent_text :] if incremental else text,
        "output_ids": seq.output_ids[output_from:],
        "meta_info": meta,
    }
    seq.sent_ids, seq.sent_text = len(seq.output_ids), max(seq.sent_text, len(text))
    event = _with_extras(event, seq)
    if with_index:
        event["index"] = seq.spec.index
    return event


def _meta_info(seq: Sequence, weight_version: str, final: bool, output_from: int = 0) -> dict:
    timing = seq.timing
    forward_entry = timing.forward_entry or timing.dispatched
    meta = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason if final else None,
        "prompt_tokens": len(seq.spec.prompt),
        "weight_version": weight_version,
        "num_retractions": seq.num_retractions,
        "forward_entry_time": forward_entry,
        "prefill_finished_time": timing.prefill_finished or forward_entry,
        "queue_time": forward_entry - timing.dispatched,
    }
    if seq.logprobs:
        meta.update(seq.logprobs.fields(output_from))
    cached = seq.cached_tokens
    meta.update(
        {
            "reasoning_tokens": 0,
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": cached,
            "cached_tokens_details": {"device": cached, "host": 0} if cached else None,
            "dp_rank": None,
        }
    )
    return meta


def _finish_times(meta: dict, seq: Sequence) -> None:
    timing = seq.timing
    finished = timing.finished or time.time()
    meta["e2e_latency"] = finished - timing.received
    meta["request_received_ts"] = timing.received
    meta["api_server_dispatch_finish_ts"] = timing.dispatched
    if timing.first_sent:
        meta["response_sent_to_client_ts"] = timing.first_sent
    meta["request_finished_ts"] = finished
    completion = len(seq.output_ids)
    if completion > 1:
        decode_s = max(finished - (timing.prefill_finished or finished), 1e-6)
        meta["decode_throughput"] = (completion - 1) / decode_s
    if not timing.first_sent:
        meta["response_sent_to_client_ts"] = time.time()


def _weight_versions(meta: dict, seq: Sequence) -> None:
    """0.5.19+ (utils/weight_versions.py add_weight_versions_to_meta_info): exact spans on the final reply."""
    if not seq.version_starts:
        return
    ends = [start for _, start in seq.version_starts[1:]] + [len(seq.output_ids)]
    meta["weight_versions"] = [{"version": v, "start": s, "end": e} for (v, s), e in zip(seq.version_starts, ends)]
    meta["weight_version"] = seq.version_starts[-1][0]


def _with_extras(body: dict, seq: Sequence) -> dict:
    if seq.spec.return_prompt_token_ids:  # SGLang adds it next to meta_info, not inside
        body["prompt_token_ids"] = seq.spec.prompt
    return body
