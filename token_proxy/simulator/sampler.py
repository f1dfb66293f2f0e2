"""Turns the fake model's candidate logits into a token, as SGLang's sampler would."""

from __future__ import annotations

import math
import random

from token_proxy.simulator.fake_model import BACKGROUND_LOGIT, GOLDEN64, MASK64, mix64
from token_proxy.simulator.sampling_params import SamplingParams


def adjust_logits(
    logits: dict[int, float],
    params: SamplingParams,
    counts: dict[int, int] | None,
    banned: frozenset[int] | set[int],
) -> dict[int, float]:
    """logit_bias, penalties and the min_new_tokens ban, applied to the candidates."""
    for token_id, bias in params.logit_bias.items():
        logits[token_id] = logits.get(token_id, BACKGROUND_LOGIT) + bias
    if counts:
        _apply_penalties(logits, params, counts)
    for token_id in banned:
        logits.pop(token_id, None)
    return logits


def _apply_penalties(logits: dict[int, float], params: SamplingParams, counts: dict[int, int]) -> None:
    for token_id, logit in logits.items():
        count = counts.get(token_id)
        if not count:
            continue
        if params.repetition_penalty != 1.0:
            logit = logit / params.repetition_penalty if logit > 0 else logit * params.repetition_penalty
        logits[token_id] = logit - params.frequency_penalty * count - params.presence_penalty


def log_softmax(logits: dict[int, float]) -> tuple[dict[int, float], float]:
    """Logprobs over the candidates, and the log-partition (to price any other id)."""
    top = max(logits.values())
    log_total = top + math.log(sum(math.exp(v - top) for v in logits.values()))
    return {token_id: value - log_total for token_id, value in logits.items()}, log_total


def choose(logits: dict[int, float], params: SamplingParams, rng: random.Random, seed_position: int) -> int:
    if params.greedy:
        return max(logits, key=logits.__getitem__)
    kept = _filtered(logits, params)
    draw = _uniform(params.sampling_seed, seed_position) if params.sampling_seed is not None else rng.random()
    total = sum(kept.values())
    for token_id, weight in kept.items():
        draw -= weight / total
        if draw < 0:
            return token_id
    return next(reversed(kept))


def _filtered(logits: dict[int, float], params: SamplingParams) -> dict[int, float]:
    """Probabilities after temperature, top_k, top_p and min_p, highest first."""
    ranked = sorted(logits.items(), key=lambda item: -item[1])[: params.top_k]
    top = ranked[0][1]
    weights = [(token_id, math.exp((value - top) / params.temperature)) for token_id, value in ranked]
    total = sum(w for _, w in weights)
    kept, mass = {}, 0.0
    for token_id, weight in weights:
        if weight < params.min_p * weights[0][1] or mass >= params.top_p * total:
            break
        kept[token_id] = weight
        mass += weight
    return kept


def _uniform(seed: int, position: int) -> float:
    # SGLang hashes (sampling_seed, position): one seed gives the same draw at a
    # position whatever the batch, so seeded n>1 samples come out identical.
    mixed = mix64(mix64(seed & MASK64) ^ ((position + 1) * GOLDEN64 & MASK64))
    return (mixed >> 11) * (1.0 / (1 << 53))
