"""The simulator's /generate semantics: determinism, sampling, stopping, lengths, logprobs, streams."""

from __future__ import annotations

import math

import orjson
import pytest
from tokenizers import Tokenizer

from token_proxy.simulator import SIM_STATE, SimConfig, create_sim_app
from token_proxy.simulator.testing import parse_sse
from token_proxy.simulator.vocab import load_vocab

CHAT = [151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198]
FOX = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
SPLITTY = [785, 3974, 13876, 1]  # greedy output splits CJK characters across byte tokens, then hits EOS
EOS = 151645
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@pytest.fixture
def make_sim(aiohttp_client, tokenizer_dir):
    async def make(**overrides):
        app = create_sim_app(SimConfig(tokenizer_path=str(tokenizer_dir), **overrides))
        return await aiohttp_client(app)

    return make


@pytest.fixture
async def sim(make_sim):
    return await make_sim()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


async def generate(client, status: int = 200, **body):
    response = await client.post("/generate", json=body)
    raw = await response.read()
    assert response.status == status, raw[:400]
    if body.get("stream") and status == 200:
        return parse_sse(raw)
    return orjson.loads(raw)


def greedy(max_new_tokens: int = 16, **extra) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, **extra}


def state(client):
    return client.server.app[SIM_STATE]


# --- determinism and sampling ---------------------------------------------------------------


async def test_greedy_is_deterministic_and_text_is_the_tokenizer_decode(sim, tokenizer):
    first = await generate(sim, input_ids=CHAT, sampling_params=greedy(32))
    second = await generate(sim, input_ids=CHAT, sampling_params=greedy(32))
    assert first["output_ids"] == second["output_ids"]
    assert len(first["output_ids"]) == 32
    assert first["text"] == tokenizer.decode(first["output_ids"])
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 32}
    assert first["meta_info"]["prompt_tokens"] == 15 and first["meta_info"]["completion_tokens"] == 32


async def test_a_longer_context_continues_the_same_greedy_path(sim):
    """The fake model is a function of the context: prompt + output[:k] continues identically."""
    full = await generate(sim, input_ids=FOX, sampling_params=greedy(12))
    resumed = await generate(sim, input_ids=FOX + full["output_ids"][:5], sampling_params=greedy(7))
    assert resumed["output_ids"] == full["output_ids"][5:]


async def test_seeds_are_ignored_without_deterministic_inference(sim):
    """SGLang's sampler reads sampling_seed only under --enable-deterministic-inference."""
    params = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 42}
    a = await generate(sim, input_ids=FOX, sampling_params=params)
    b = await generate(sim, input_ids=FOX, sampling_params=params)
    assert a["output_ids"] != b["output_ids"]
    info = await (await sim.get("/server_info")).json()
    assert info["enable_deterministic_inference"] is False


async def test_seeded_sampling_repeats_and_seeds_differ(make_sim):
    sim = await make_sim(enable_deterministic_inference=True)
    params = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 42}
    a = await generate(sim, input_ids=FOX, sampling_params=params)
    b = await generate(sim, input_ids=FOX, sampling_params=params)
    c = await generate(sim, input_ids=FOX, sampling_params={**params, "sampling_seed": 43})
    g = await generate(sim, input_ids=FOX, sampling_params=greedy(24))
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]
    assert a["output_ids"] != g["output_ids"]


async def test_unseeded_sampling_varies(sim):
    params = {"max_new_tokens": 24, "temperature": 1.0}
    outputs = {
        tuple((await generate(sim, input_ids=FOX, sampling_params=params))["output_ids"]) for _ in range(3)
    }
    assert len(outputs) == 3


async def test_weight_version_is_part_of_the_model(sim):
    before = await generate(sim, input_ids=FOX, sampling_params=greedy(8))
    response = await sim.post("/update_weight_version", json={"new_version": "step-7"})
    assert await response.json() == {
        "success": True,
        "message": "Weight version updated to step-7",
        "new_version": "step-7",
    }
    after = await generate(sim, input_ids=FOX, sampling_params=greedy(8))
    assert after["meta_info"]["weight_version"] == "step-7"
    assert after["output_ids"] != before["output_ids"]


# --- lengths -------------------------------------------------------------------------------


async def test_max_new_tokens_defaults_to_128(sim):
    out = await generate(sim, input_ids=FOX, sampling_params={"temperature": 0, "ignore_eos": True})
    assert len(out["output_ids"]) == 128
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 128}


async def test_max_new_tokens_null_runs_to_the_context_limit(make_sim):
    sim = await make_sim(context_length=64)
    out = await generate(sim, input_ids=FOX, sampling_params=greedy(None, ignore_eos=True))
    # SGLang clamps to max_req_len - input - 1 = (64 - 1) - 10 - 1.
    assert len(out["output_ids"]) == 52
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 52}


async def test_absent_max_new_tokens_is_clamped_not_refused(make_sim):
    sim = await make_sim(context_length=64)
    out = await generate(
        sim, input_ids=list(range(1, 51)), sampling_params={"temperature": 0, "ignore_eos": True}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


async def test_context_errors(make_sim):
    sim = await make_sim(context_length=64)
    too_long = await generate(sim, 400, input_ids=[100] * 64, sampling_params=greedy(1))
    assert too_long == {
        "error": {"message": "The input (64 tokens) is longer than the model's context length (64 tokens)."}
    }
    over = await generate(sim, 400, input_ids=[100] * 50, sampling_params=greedy(20))
    assert over["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 64 tokens. "
        "You requested a total of 70 tokens: 50 tokens from the input messages and 20 tokens for the "
        "completion."
    )
    # 58..63 input tokens pass the tokenizer check but not the scheduler's max_req_input_len (= 64 - 6).
    near = await generate(sim, 400, input_ids=[100] * 58, sampling_params=greedy(2))
    assert near == {
        "error": {
            "message": "Input length (58 tokens) exceeds the maximum allowed length (58 tokens). "
            "Use a shorter input or enable --allow-auto-truncate."
        }
    }
    events = await generate(sim, input_ids=[100] * 58, sampling_params=greedy(2), stream=True)
    assert events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["output_ids"] == [] and events[0]["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": near["error"]["message"],
        "status_code": 400,
        "err_type": "BadRequestError",
    }


async def test_max_new_tokens_zero(sim):
    out = await generate(sim, input_ids=CHAT, sampling_params=greedy(0))
    assert (out["text"], out["output_ids"]) == ("", [])
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert "decode_throughput" not in out["meta_info"]


# --- stopping ------------------------------------------------------------------------------


async def test_eos_forced_by_logit_bias_after_min_new_tokens(sim, tokenizer):
    params = greedy(32, min_new_tokens=4, logit_bias={str(EOS): 100.0})
    out = await generate(sim, input_ids=CHAT, sampling_params=params)
    assert len(out["output_ids"]) == 5 and out["output_ids"][-1] == EOS
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    assert out["text"] == tokenizer.decode(out["output_ids"][:4])
    shown = await generate(
        sim, input_ids=CHAT, sampling_params={**params, "skip_special_tokens": False, "no_stop_trim": True}
    )
    assert shown["text"] == out["text"] + "<|im_end|>"


async def test_ignore_eos_keeps_emitting_eos_until_length(sim):
    out = await generate(
        sim, input_ids=CHAT, sampling_params=greedy(6, ignore_eos=True, logit_bias={str(EOS): 100})
    )
    assert out["output_ids"] == [EOS] * 6 and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


async def test_greedy_sometimes_stops_on_eos_by_itself(sim):
    out = await generate(sim, input_ids=SPLITTY, sampling_params=greedy(128))
    assert out["output_ids"][-1] == EOS and len(out["output_ids"]) == 43
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}


async def test_stop_token_ids(sim, tokenizer):
    probe = await generate(sim, input_ids=CHAT, sampling_params=greedy(8))
    target = probe["output_ids"][2]
    out = await generate(sim, input_ids=CHAT, sampling_params=greedy(8, stop_token_ids=[target]))
    assert out["output_ids"] == probe["output_ids"][:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert out["text"] == tokenizer.decode(probe["output_ids"][:2])


async def test_stop_strings_trim_unless_no_stop_trim(sim):
    probe = await generate(sim, input_ids=FOX, sampling_params=greedy(8))
    text = probe["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    out = await generate(sim, input_ids=FOX, sampling_params=greedy(8, stop=[stop, "never-seen"]))
    assert out["text"] == text[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == probe["output_ids"][: len(out["output_ids"])] and len(out["output_ids"]) < 8
    kept = await generate(sim, input_ids=FOX, sampling_params=greedy(8, stop=stop, no_stop_trim=True))
    assert kept["text"] == text[: cut + len(stop)]


async def test_stream_holds_back_a_possible_stop_string_prefix(sim):
    probe = await generate(sim, input_ids=FOX, sampling_params=greedy(8))
    pieces = [await generate(sim, input_ids=FOX, sampling_params=greedy(k)) for k in (3, 4)]
    stop = pieces[0]["text"][-2:] + pieces[1]["text"][len(pieces[0]["text"]) :][:2]  # spans tokens 3 and 4
    events = await generate(sim, input_ids=FOX, sampling_params=greedy(8, stop=[stop]), stream=True)
    sent = [e["output_ids"] for e in events[:-1]]
    assert [len(ids) for ids in sent] == [1, 2, 4]  # the event after token 3 (ending in the prefix) is held
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert events[-2]["text"] == probe["text"][: probe["text"].find(stop)]


# --- n > 1 and batches ---------------------------------------------------------------------


async def test_n2_children_share_a_parent_rid(sim):
    outs = await generate(sim, rid="parent", input_ids=CHAT, sampling_params=greedy(4, n=2))
    assert len(outs) == 2 and outs[0]["output_ids"] == outs[1]["output_ids"]
    for out in outs:
        parent, child = out["meta_info"]["id"].split("_")
        assert parent == "parent" and len(child) == 32
        assert out["meta_info"]["cached_tokens"] == 14  # the shared prompt is prefilled once first
    sampled = await generate(
        sim, input_ids=CHAT, sampling_params={"max_new_tokens": 8, "temperature": 1.0, "n": 2}
    )
    assert sampled[0]["output_ids"] != sampled[1]["output_ids"]
    assert sampled[0]["meta_info"]["id"].split("_")[0] == sampled[1]["meta_info"]["id"].split("_")[0]


async def test_batch_with_per_item_params_rids_and_logprob_flags(sim):
    outs = await generate(
        sim,
        input_ids=[CHAT, FOX],
        rid=["a", "b"],
        return_logprob=[True, False],
        sampling_params=[greedy(2), greedy(3)],
    )
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b"]
    assert [len(o["output_ids"]) for o in outs] == [2, 3]
    assert (
        "output_token_logprobs" in outs[0]["meta_info"]
        and "output_token_logprobs" not in outs[1]["meta_info"]
    )
    named = await generate(sim, input_ids=[CHAT, FOX], rid="job", sampling_params=greedy(1))
    assert [o["meta_info"]["id"] for o in named] == ["job_0", "job_1"]


async def test_batch_stream_events_interleave_with_index(sim):
    events = await generate(sim, input_ids=[CHAT, FOX], sampling_params=greedy(3), stream=True)
    assert events[-1] == "[DONE]"
    assert sorted(e["index"] for e in events[:-1]) == [0, 0, 0, 1, 1, 1]
    assert [e["meta_info"]["completion_tokens"] for e in events[:-1] if e["index"] == 1] == [1, 2, 3]
    n_events = await generate(sim, input_ids=FOX, sampling_params=greedy(2, n=3), stream=True)
    assert sorted(e["index"] for e in n_events[:-1]) == [0, 0, 1, 1, 2, 2]


async def test_text_prompt_and_prompt_token_ids(sim, tokenizer):
    out = await generate(
        sim, text="The quick brown fox", sampling_params=greedy(2), return_prompt_token_ids=True
    )
    assert out["meta_info"]["prompt_tokens"] == 4
    assert out["prompt_token_ids"] == tokenizer.encode("The quick brown fox").ids == [785, 3974, 13876, 38835]
    assert list(out) == ["text", "output_ids", "meta_info", "prompt_token_ids"]


async def test_prefix_cache_counts_previously_seen_tokens(sim):
    first = await generate(sim, input_ids=FOX, sampling_params=greedy(2))
    assert (first["meta_info"]["cached_tokens"], first["meta_info"]["cached_tokens_details"]) == (0, None)
    again = await generate(sim, input_ids=FOX + first["output_ids"] + [7], sampling_params=greedy(2))
    assert again["meta_info"]["cached_tokens"] == 12
    assert again["meta_info"]["cached_tokens_details"] == {"device": 12, "host": 0}
    response = await sim.post("/flush_cache")
    assert response.status == 200
    flushed = await generate(sim, input_ids=FOX, sampling_params=greedy(2))
    assert flushed["meta_info"]["cached_tokens"] == 0


async def test_extra_key_isolates_the_prefix_cache(sim):
    """SGLang keys its radix cache by extra_key (the proxy's cache_salt): another key shares nothing."""
    await generate(sim, input_ids=FOX, sampling_params=greedy(1))
    salted = await generate(sim, input_ids=FOX, sampling_params=greedy(1), extra_key="tenant-a")
    assert salted["meta_info"]["cached_tokens"] == 0
    again = await generate(sim, input_ids=FOX, sampling_params=greedy(1), extra_key="tenant-a")
    assert again["meta_info"]["cached_tokens"] == len(FOX) - 1
    other = await generate(sim, input_ids=FOX, sampling_params=greedy(1), extra_key="tenant-b")
    assert other["meta_info"]["cached_tokens"] == 0
    unsalted = await generate(sim, input_ids=FOX, sampling_params=greedy(1))
    assert unsalted["meta_info"]["cached_tokens"] == len(FOX) - 1


async def test_extra_key_per_prompt_must_match_the_batch(sim):
    resp = await sim.post("/generate", json={"input_ids": [FOX, FOX], "extra_key": ["a"],
                                             "sampling_params": greedy(1)})
    assert resp.status == 400
    assert "extra_key" in (await resp.text())


async def test_cached_token_metrics_agree_with_the_replies(sim):
    from token_proxy.simulator.metrics import metrics_text

    replies = [await generate(sim, input_ids=FOX, sampling_params=greedy(1)) for _ in range(3)]
    cached = sum(reply["meta_info"]["cached_tokens"] for reply in replies)
    prompt = sum(reply["meta_info"]["prompt_tokens"] for reply in replies)
    assert cached == 2 * (len(FOX) - 1)
    text = metrics_text(sim.app[SIM_STATE])
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if not line.startswith("#")}
    assert values["sglang:cached_tokens_total"] == cached
    assert values["sglang:prompt_tokens_total"] == prompt
    assert values["sglang:cache_hit_rate"] == pytest.approx(cached / prompt)


# --- logprobs ------------------------------------------------------------------------------


async def test_logprob_shapes_and_values(sim):
    out = await generate(
        sim,
        input_ids=CHAT,
        sampling_params=greedy(5),
        return_logprob=True,
        top_logprobs_num=3,
        token_ids_logprob=[EOS, 198],
        logprob_start_len=0,
        return_text_in_logprobs=True,
    )
    meta, vocab = out["meta_info"], load_vocab(str(state(sim).config.tokenizer_path))
    assert list(meta)[8:15] == [
        "input_token_logprobs",
        "output_token_logprobs",
        "output_token_logprobs_length",
        "input_top_logprobs",
        "output_top_logprobs",
        "input_token_ids_logprobs",
        "output_token_ids_logprobs",
    ]
    assert meta["input_token_logprobs"][0] == [None, CHAT[0], "<|im_start|>"]
    assert [e[1] for e in meta["input_token_logprobs"]] == CHAT
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == 15
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["output_token_logprobs_length"] == 5
    for entry, top, ids_row in zip(
        meta["output_token_logprobs"],
        meta["output_top_logprobs"],
        meta["output_token_ids_logprobs"],
        strict=True,
    ):
        assert math.isfinite(entry[0]) and entry[0] < 0 and entry[2] == vocab.text_of(entry[1])
        assert top[0] == entry  # greedy picks the most likely candidate
        assert len(top) == 3 and [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
        assert [r[1] for r in ids_row] == [EOS, 198] and all(math.isfinite(r[0]) for r in ids_row)


async def test_logprobs_default_to_output_only_without_text(sim):
    out = await generate(sim, input_ids=CHAT, sampling_params=greedy(3), return_logprob=True)
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == [] and "input_top_logprobs" not in meta
    assert [type(x) for x in meta["output_token_logprobs"][0]] == [float, int, type(None)]


# --- streaming -----------------------------------------------------------------------------


async def test_cumulative_stream_repeats_everything_so_far(sim):
    full = await generate(sim, input_ids=CHAT, sampling_params=greedy(6), return_logprob=True)
    events = await generate(sim, input_ids=CHAT, sampling_params=greedy(6), return_logprob=True, stream=True)
    assert events[-1] == "[DONE]" and len(events) == 7
    for k, event in enumerate(events[:-1], start=1):
        assert event["output_ids"] == full["output_ids"][:k]
        assert len(event["meta_info"]["output_token_logprobs"]) == k
        assert event["meta_info"]["finish_reason"] is (None if k < 6 else event["meta_info"]["finish_reason"])
    assert events[-2]["text"] == full["text"]
    assert events[-2]["meta_info"]["output_token_logprobs"] == full["meta_info"]["output_token_logprobs"]


async def test_stream_eos_event_adds_the_id_but_no_text(sim):
    params = greedy(32, min_new_tokens=4, logit_bias={str(EOS): 100.0})
    events = await generate(sim, input_ids=CHAT, sampling_params=params, stream=True)
    last, before = events[-2], events[-3]
    assert last["output_ids"] == before["output_ids"] + [EOS]
    assert last["text"] == before["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}


async def test_incremental_stream_deltas_rebuild_the_output(make_sim, tokenizer):
    sim = await make_sim(incremental_streaming_output=True)
    events = await generate(
        sim, input_ids=SPLITTY, sampling_params=greedy(64), return_logprob=True, stream=True
    )
    body = events[:-1]
    ids = [i for e in body for i in e["output_ids"]]
    text = "".join(e["text"] for e in body)
    assert ids[-1] == EOS and text == tokenizer.decode(ids)
    assert [e[1] for ev in body for e in ev["meta_info"]["output_token_logprobs"]] == ids
    assert body[-1]["meta_info"]["output_token_logprobs_length"] == len(ids)
    assert all("\ufffd" not in e["text"] for e in body)
    held = [e for e in body if e["text"] == "" and e["output_ids"] and e["output_ids"] != [EOS]]
    assert held, "a byte token that splits a character must show up with its text held back"


async def test_incremental_text_never_ends_mid_character(make_sim, tokenizer):
    sim = await make_sim(incremental_streaming_output=True, enable_deterministic_inference=True)
    for seed in range(4):
        params = {"max_new_tokens": 96, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}
        events = await generate(sim, input_ids=SPLITTY, sampling_params=params, stream=True)
        ids = [i for e in events[:-1] for i in e["output_ids"]]
        assert "".join(e["text"] for e in events[:-1]) == tokenizer.decode(ids)
        assert all("\ufffd" not in e["text"] for e in events[:-1])


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
        ({"temperature": -1}, "temperature must be a non-negative finite number, got -1."),
        (
            {"min_new_tokens": 9, "max_new_tokens": 4},
            "min_new_tokens must be in [0, max_new_tokens(4)], got 9.",
        ),
        ({"logit_bias": {"151936": 1.0}}, "logit_bias must has keys in [0, 151935], got 151936."),
        (
            {"regex": "a", "json_schema": "{}"},
            "Only one of json_schema, regex, ebnf, or structural_tag can be set.",
        ),
    ],
)
async def test_invalid_sampling_values_are_400(sim, params, message):
    assert await generate(sim, 400, input_ids=FOX, sampling_params=params) == {"error": {"message": message}}


async def test_unknown_sampling_key_is_named_from_0_5_22(make_sim):
    sim = await make_sim(sglang_version="0.5.22")
    out = await generate(sim, 400, input_ids=FOX, sampling_params={"min_tokens": 3}, stream=True)
    assert out["error"].startswith("unknown field `min_tokens`, expected one of `max_new_tokens`, `stop`")
    assert out["error"].endswith("`custom_params`, `beam_width`, `watermark`")


async def test_unknown_sampling_key_is_a_bare_500_on_0_5_17(sim):
    response = await sim.post("/generate", json={"input_ids": FOX, "sampling_params": {"min_tokens": 3}})
    assert (response.status, await response.text()) == (500, "Internal Server Error")


async def test_wrong_type_is_a_bare_500(sim):
    response = await sim.post("/generate", json={"input_ids": FOX, "sampling_params": {"temperature": "hot"}})
    assert (response.status, response.content_type, await response.text()) == (
        500,
        "text/plain",
        "Internal Server Error",
    )


async def test_stream_errors_arrive_as_sse_events(sim):
    events = await generate(sim, input_ids=[], stream=True)
    assert events == [
        {
            "error": {
                "message": "input_ids cannot be empty.",
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
        },
        "[DONE]",
    ]


async def test_body_type_errors_use_fastapi_validation_shape(sim):
    out = await generate(sim, 400, input_ids=["a", "b"])
    assert (out["object"], out["type"], out["code"], out["param"]) == ("error", "Bad Request", 400, None)
    assert "'loc': ('body', 'input_ids')" in out["message"]


async def test_out_of_vocab_id_crashes_the_server(sim):
    ok = await generate(
        sim, input_ids=[1, 2, 151800], sampling_params=greedy(2)
    )  # in the model, not the tokenizer
    assert len(ok["output_ids"]) == 2
    response = await sim.post("/generate", json={"input_ids": [1, 2, 151936], "sampling_params": greedy(2)})
    assert response.status == 500 and state(sim).crashed is True
    assert (await sim.get("/health")).status == 503
    assert (await sim.post("/generate", json={"input_ids": FOX})).status == 503


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": FOX, "sampling_params": {"n": "2"}},
        {"input_ids": [FOX, FOX], "return_logprob": [True]},
        {"input_ids": FOX, "sampling_params": {"stop": 5}},
        {"input_ids": FOX, "sampling_params": {"max_new_tokens": 2.5}},
    ],
)
async def test_other_malformed_values_are_bare_500s(sim, body):
    response = await sim.post("/generate", json=body)
    assert (response.status, await response.text()) == (500, "Internal Server Error")
