"""Every output rule through every inference endpoint, streaming and not: they must all agree.

One prompt (the ids chat renders) goes to chat, chat/tokens, completions and generate, each
streamed and not, against SGLang streaming cumulatively and incrementally. Each reply is
reduced to what the rule decides (per choice: token ids, finish_reason, stop_reason, and the
logprobs and text where the endpoint has them) and the variants are compared exactly, with
the expected ids of each rule checked against an unconstrained reference run.
"""

from __future__ import annotations

import orjson
import pytest

from token_proxy.simulator.testing import stream_events

USER = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
ENDPOINTS = ("chat", "chat/tokens", "completions", "generate")
TEXT_ENDPOINTS = ("chat", "chat/tokens", "completions")


def _body(endpoint: str, prompt_ids: list[int], params: dict, stream: bool) -> tuple[str, dict]:
    params = dict(params)
    logprobs = params.pop("logprobs", None)
    if endpoint == "generate":
        sampling = dict(params, **({"logprobs": logprobs} if logprobs is not None else {}))
        body = {"token_ids": prompt_ids, "sampling_params": sampling, "stream": stream}
        return "/inference/v1/generate", body
    body = dict(params, stream=stream, return_token_ids=True)
    if endpoint == "completions":
        if logprobs is not None:
            body["logprobs"] = logprobs
        return "/v1/completions", dict(body, prompt=prompt_ids)
    if logprobs is not None:
        body.update(logprobs=True, top_logprobs=logprobs)
    if endpoint == "chat":
        return "/v1/chat/completions", dict(body, messages=USER)
    return "/v1/chat/completions/tokens", dict(body, messages=USER, tokens=prompt_ids)


def _logprob_values(endpoint: str, logprobs: dict | None) -> list[float]:
    if not logprobs:
        return []
    if endpoint == "completions":
        return logprobs["token_logprobs"]
    return [entry["logprob"] for entry in logprobs["content"]]


def _choice_view(endpoint: str, choice: dict, text: str | None) -> dict:
    return {"token_ids": choice["token_ids"], "finish_reason": choice["finish_reason"],
            "stop_reason": choice["stop_reason"], "logprobs": _logprob_values(endpoint, choice.get("logprobs")),
            "text": text}


def _text(endpoint: str, choice: dict) -> str | None:
    if endpoint == "completions":
        return choice["text"]
    if endpoint == "generate":
        return None
    return choice.get("message", {}).get("content")


def _whole(endpoint: str, reply: dict) -> dict[int, dict]:
    return {c["index"]: _choice_view(endpoint, c, _text(endpoint, c)) for c in reply["choices"]}


def _streamed(endpoint: str, events: list[dict]) -> dict[int, dict]:
    views: dict[int, dict] = {}
    for event in events:
        for choice in event.get("choices") or []:
            view = views.setdefault(choice["index"], {"token_ids": [], "finish_reason": None, "stop_reason": None,
                                                      "logprobs": [], "text": None if endpoint == "generate" else ""})
            view["token_ids"] += choice.get("token_ids") or []
            view["logprobs"] += _logprob_values(endpoint, choice.get("logprobs"))
            if endpoint == "completions":
                view["text"] += choice["text"]
            elif endpoint != "generate":
                view["text"] += choice["delta"].get("content") or ""
            if choice.get("finish_reason") is not None:
                view["finish_reason"], view["stop_reason"] = choice["finish_reason"], choice.get("stop_reason")
    return views


async def _run(proxy, endpoint: str, prompt_ids: list[int], params: dict, stream: bool) -> dict[int, dict]:
    path, body = _body(endpoint, prompt_ids, params, stream)
    resp = await proxy.post(path, data=orjson.dumps(body))
    raw = await resp.read()
    assert resp.status == 200, raw
    if stream:
        return _streamed(endpoint, stream_events(raw))
    return _whole(endpoint, orjson.loads(raw))


async def _all_variants(proxy, prompt_ids: list[int], params: dict) -> dict[tuple[str, bool], dict[int, dict]]:
    return {(endpoint, stream): await _run(proxy, endpoint, prompt_ids, params, stream)
            for endpoint in ENDPOINTS for stream in (False, True)}


def _assert_agree(variants: dict) -> dict[int, dict]:
    """Every variant equals chat's non-streaming reply (text only among the endpoints that have it)."""
    reference = variants[("chat", False)]
    for (endpoint, stream), views in variants.items():
        assert sorted(views) == sorted(reference), (endpoint, stream)
        for index, view in views.items():
            want = dict(reference[index])
            got = dict(view)
            if endpoint == "generate":
                want.pop("text"), got.pop("text")
            assert got == want, (endpoint, stream, index)
    return reference


@pytest.fixture(params=[False, True], ids=["cumulative", "incremental"])
async def setup(request, make_sim, make_proxy):
    sim = await make_sim(incremental_streaming_output=request.param)
    proxy = await make_proxy(sim)
    resp = await proxy.post("/tokenize", data=orjson.dumps({"messages": USER}))
    prompt_ids = (await resp.json())["tokens"]
    base = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    reference = (await _run(proxy, "generate", prompt_ids, base, False))[0]["token_ids"]
    assert len(reference) == 24
    return proxy, prompt_ids, reference


async def _decode(proxy, ids: list[int]) -> str:
    resp = await proxy.post("/detokenize", data=orjson.dumps({"tokens": ids}))
    return (await resp.json())["prompt"]


def _first_fresh(reference: list[int], start: int) -> int:
    """A position whose token did not occur earlier (so a stop at it is the first hit)."""
    return next(i for i in range(start, len(reference)) if reference[i] not in reference[:i])


@pytest.mark.parametrize("ignore_eos", [False, True])
async def test_stop_token_ids(setup, ignore_eos):
    proxy, prompt_ids, reference = setup
    cut = _first_fresh(reference, 3)
    stop_id = reference[cut]
    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": ignore_eos, "stop_token_ids": [stop_id]}
    (choice,) = _assert_agree(await _all_variants(proxy, prompt_ids, params)).values()
    assert choice["token_ids"] == reference[: cut + 1]  # the stop id is kept, as vLLM keeps it
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
    assert choice["text"] == await _decode(proxy, reference[:cut])  # its text is not


@pytest.mark.parametrize("include", [False, True])
async def test_stop_strings(setup, include):
    proxy, prompt_ids, reference = setup
    texts = [await _decode(proxy, [t]) for t in reference]
    # the first token whose text first occurs where that token ends the output (so it stops there)
    cut = next(i for i in range(2, len(texts))
               if texts[i].strip() and "".join(texts[: i + 1]).find(texts[i]) == len("".join(texts[:i])))
    stop = texts[cut]
    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, "stop": [stop],
              "include_stop_str_in_output": include}
    (choice,) = _assert_agree(await _all_variants(proxy, prompt_ids, params)).values()
    assert choice["token_ids"] == reference[: cut + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    before = "".join(texts[:cut])
    assert choice["text"] == (before + stop if include else before)


async def test_max_tokens_truncation(setup):
    proxy, prompt_ids, reference = setup
    params = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
    (choice,) = _assert_agree(await _all_variants(proxy, prompt_ids, params)).values()
    assert choice["token_ids"] == reference[:5]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)


async def test_n_samples_agree_per_choice(setup):
    proxy, prompt_ids, _ = setup
    params = {"temperature": 1.0, "seed": 11, "n": 3, "max_tokens": 6, "ignore_eos": True}
    choices = _assert_agree(await _all_variants(proxy, prompt_ids, params))
    assert sorted(choices) == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in choices.values()}) == 3  # seed, seed+1, ...: different samples
    assert all(c["finish_reason"] == "length" and len(c["token_ids"]) == 6 for c in choices.values())


async def test_n_samples_with_stop_ids_under_ignore_eos(setup):
    proxy, prompt_ids, reference = setup
    stop_id = reference[_first_fresh(reference, 2)]
    params = {"temperature": 0, "n": 2, "max_tokens": 24, "ignore_eos": True, "stop_token_ids": [stop_id]}
    choices = _assert_agree(await _all_variants(proxy, prompt_ids, params))
    assert [c["stop_reason"] for c in choices.values()] == [stop_id, stop_id]


async def test_logprobs(setup):
    proxy, prompt_ids, reference = setup
    params = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 2}
    (choice,) = _assert_agree(await _all_variants(proxy, prompt_ids, params)).values()
    assert choice["token_ids"] == reference[:6]
    assert len(choice["logprobs"]) == 6 and all(isinstance(lp, float) for lp in choice["logprobs"])


async def test_logprobs_cut_with_stop_ids_under_ignore_eos(setup):
    proxy, prompt_ids, reference = setup
    cut = _first_fresh(reference, 3)
    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, "stop_token_ids": [reference[cut]],
              "logprobs": 1}
    (choice,) = _assert_agree(await _all_variants(proxy, prompt_ids, params)).values()
    assert len(choice["logprobs"]) == len(choice["token_ids"]) == cut + 1


@pytest.mark.parametrize("skip", [False, True])
async def test_skip_special_tokens(setup, skip):
    proxy, prompt_ids, _ = setup
    eos = 151645  # <|im_end|>: generated text that contains it shows it only when not skipped
    params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "skip_special_tokens": skip,
              "logit_bias": {str(eos): 100}}
    (choice,) = _assert_agree(await _all_variants(proxy, prompt_ids, params)).values()
    assert eos in choice["token_ids"]
    assert ("<|im_end|>" in choice["text"]) is (not skip)
