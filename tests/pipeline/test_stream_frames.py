"""The stream's template path (pipeline/stream_frames.py) writes byte for byte what the general path
(output rules -> formatter -> orjson) writes: every case runs both over the same SGLang events."""

from __future__ import annotations

import pytest

from token_proxy.api import TokenNamer
from token_proxy.api.chat import parse_chat_request
from token_proxy.api.chat.format import ChatFormatter
from token_proxy.api.completions import parse_completion_request
from token_proxy.api.completions.format import CompletionFormatter
from token_proxy.api.generate import parse_generate_tokens
from token_proxy.api.generate.format import GenerateFormatter
from token_proxy.pipeline import output_rules as output_rules_module
from token_proxy.pipeline.output_rules import OutputRules
from token_proxy.pipeline.stream_frames import TEXT_PROBE, StreamFrames
from token_proxy.vocabulary import ResponseMeta

VOCAB = 151665
EOS = 151645
PROMPT = [11, 12, 13]


class Texts:
    def text(self, token_id):
        return f"<{token_id}>"


class General:
    """The same formatter, declared not plain: StreamFrames takes the general way for every event."""

    plain_chunks = False

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def chat(model="m", **body):
    req = parse_chat_request({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                              **body}, VOCAB)
    meta = ResponseMeta("chatcmpl-7", 1700000000, model, [PROMPT])
    return req.sampling, lambda: ChatFormatter(req, meta, TokenNamer(Texts(), False))


def completion(**body):
    req = parse_completion_request({"model": "m", "prompt": PROMPT, "stream": True, **body}, VOCAB)
    meta = ResponseMeta("cmpl-7", 1700000000, "m", [PROMPT])
    return req.sampling, lambda: CompletionFormatter(req, meta, TokenNamer(Texts(), False), ["the prompt"])


def generate(**body):
    req = parse_generate_tokens({"model": "m", "token_ids": PROMPT, "stream": True, **body}, VOCAB)
    meta = ResponseMeta("generate-tokens-7", 1700000000, "m", [PROMPT])
    return req.sampling, lambda: GenerateFormatter(req, meta, TokenNamer(Texts(), False))


def event(text, ids, finish=None, index=None, **meta):
    ev = {"text": text, "output_ids": ids,
          "meta_info": {"id": "x", "finish_reason": finish, "prompt_tokens": 3, "weight_version": "default",
                        "completion_tokens": 1, "cached_tokens": 2, **meta}}
    if index is not None:
        ev["index"] = index
    return ev


def run(sampling, make_formatter, batches, *, general: bool, incremental=True):
    rules = OutputRules(sampling, 1, len(PROMPT), EOS, lambda ids: "".join(f"<{i}>" for i in ids), incremental)
    formatter = make_formatter()
    frames = StreamFrames(rules, General(formatter) if general else formatter)
    out = [frames.start(batches[0])]
    out += [frames.frames(batch) for batch in batches[1:]]
    if rules.done:
        out.append(frames.finish())
    # What the request's stats record besides the bytes.
    return b"".join(out), frames, (rules.usage(), rules.weight_version, rules.done)


def assert_same_bytes(sampling, make_formatter, batches, templated=True, incremental=True) -> bytes:
    fast, frames, fast_stats = run(sampling, make_formatter, batches, general=False, incremental=incremental)
    slow, _, slow_stats = run(sampling, make_formatter, batches, general=True, incremental=incremental)
    assert fast == slow
    assert fast_stats == slow_stats
    assert (frames._template is not None) is templated  # the case did (or did not) exercise the template
    return fast


WORDS = ["Hello", ",", " wor", "ld", " \"quoted\"", " back\\slash", "\n", "\ttab", "\x01ctl", " é", " 漢字", " 🙂",
         "</script>", " \u2028"]
STOP_EOS = {"type": "stop", "matched": EOS}


def words(n: int | None = None, start=100):
    return [[event(WORDS[i % len(WORDS)], [start + i])] for i in range(len(WORDS) if n is None else n)]


ENDINGS = {
    "eos": event("", [EOS], STOP_EOS),
    "stop id": event("", [7], {"type": "stop", "matched": 7}),
    "length": event(" end", [99], {"type": "length", "length": 20}),
    "abort": event("", [], {"type": "abort", "message": "client gone"}),
}

FORMATS = {
    "chat": lambda **kw: chat(**kw),
    "chat+ids": lambda **kw: chat(return_token_ids=True, **kw),
    "chat+ids+usage": lambda **kw: chat(return_token_ids=True, stream_options={"include_usage": True}, **kw),
    "completion": lambda **kw: completion(**kw),
    "completion+ids+echo": lambda **kw: completion(return_token_ids=True, echo=True, **kw),
    "completion+usage": lambda **kw: completion(stream_options={"include_usage": True}, **kw),
    "generate": lambda **kw: generate(**kw),
    "generate+usage": lambda **kw: generate(stream_options={"include_usage": True}, **kw),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_template_bytes_equal_the_general_path(fmt, ending):
    sampling, make = FORMATS[fmt]()
    raw = assert_same_bytes(sampling, make, words() + [[ENDINGS[ending]]])
    assert raw.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_batched_reads_partial_utf8_and_empty_events(fmt):
    """Several events per read; text held back at an incomplete character (U+FFFD) while its ids go out;
    events with ids but no text, with neither, and an explicit index 0."""
    sampling, make = FORMATS[fmt]()
    batches = [
        [event("A", [1]), event("b", [2])],
        [event("c\ufffd", [3]), event("\ufffd", [4])],
        [event("", [5]), event("é", [6], index=0)],
        [event("", [])],
        [event("\ufffd\ufffd", [8]), event("🙂x", [9]), event("y", [10]), event("", [EOS], STOP_EOS)],
    ]
    raw = assert_same_bytes(sampling, make, batches)
    assert ("🙂x".encode() in raw) is not fmt.startswith("generate")  # /generate's chunks carry no text


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_one_event_per_read_partial_utf8_and_empty_events(fmt):
    """The same events, one per read (the frames' single-event way): held-back text, ids without text,
    an event with neither (writes nothing), a weight version that changes mid-stream."""
    sampling, make = FORMATS[fmt]()
    events = [event("A", [1]), event("c\ufffd", [3]), event("\ufffd", [4]), event("", [5]), event("", []),
              event("é", [6], index=0), event("x", [7], weight_version="v2"), event("\ufffd\ufffd", [8]),
              event("🙂x", [9], cached_tokens=0), event("", [EOS], STOP_EOS)]
    raw = assert_same_bytes(sampling, make, [[ev] for ev in events])
    assert ("🙂x".encode() in raw) is not fmt.startswith("generate")
    assert raw.count(b"data: ") == raw.count(b"\n\n")


@pytest.mark.parametrize("fmt", ["chat+ids", "completion+ids+echo", "generate"])
def test_weight_version_changes_give_the_same_spans(fmt):
    sampling, make = FORMATS[fmt]()
    batches = [[event("a", [1], weight_version="v1")], [event("b", [2], weight_version="v1")],
               [event("c", [3], weight_version="v2"), event("", [], weight_version="v3")],
               [event("d", [4], weight_version="v3")], [event("e", [5])], [event("", [], weight_version=None)],
               [event("", [EOS], STOP_EOS, weight_version="v3")]]
    raw = assert_same_bytes(sampling, make, batches)
    assert (b'"weight_versions":[{"version":"v1","start":0,"end":2},{"version":"v2","start":2,"end":3},'
            b'{"version":"v3","start":3,"end":4},{"version":"default","start":4,"end":5},'
            b'{"version":"v3","start":5,"end":6}]') in raw


def test_cached_tokens_reach_the_usage_chunk():
    sampling, make = FORMATS["chat+ids+usage"]()
    batches = [[event("a", [1], cached_tokens=0)], [event("b", [2], cached_tokens=3)],
               [event("c", [3], cached_tokens=0)], [event("", [EOS], STOP_EOS, cached_tokens=None)]]
    raw = assert_same_bytes(sampling, make, batches)
    assert b'"usage":{"prompt_tokens":3,"total_tokens":7,"completion_tokens":4,' \
           b'"prompt_tokens_details":{"cached_tokens":3}}' in raw


def test_stream_cut_off_without_a_finish_writes_the_same_chunks():
    sampling, make = FORMATS["chat+ids"]()
    assert_same_bytes(sampling, make, words(5) + [[event("z", [9], weight_version="v9")]])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_first_read_of_many_events_takes_the_template_after_its_first_chunk(fmt, monkeypatch):
    """A fast engine's first read holds many events: only those before the first chunk (an event held
    back entirely too) and the last take the general way, the rest of that read the template."""
    general = []
    feed = OutputRules.feed
    monkeypatch.setattr(OutputRules, "feed", lambda self, ev: general.append(ev["text"]) or feed(self, ev))
    sampling, make = FORMATS[fmt]()
    first = [event("\ufffd", []), event("A\ufffd", [1]), *(event(w, [i]) for i, w in enumerate(WORDS, 2))]
    batches = [first, [event("x", [90]), event("", [EOS], STOP_EOS)]]
    assert_same_bytes(sampling, make, batches)
    general.clear()
    run(sampling, make, batches, general=False)
    # generate's chunks carry no text: its first chunk (the ids of "A") is out at the 2nd event too.
    assert general == ["\ufffd", "A\ufffd", ""]


@pytest.mark.parametrize("fmt,body", [
    ("chat", {"n": 2}),
    ("chat", {"logprobs": True}),
    ("chat", {"stop": ["xyz"]}),
    ("chat", {"ignore_eos": True, "stop_token_ids": [7]}),
    ("chat+ids+usage", {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("completion", {"logprobs": 2}),
    ("generate", {"sampling_params": {"logprobs": 1}}),
])
def test_only_plain_streams_take_the_template(fmt, body):
    sampling, make = FORMATS[fmt](**body) if fmt != "chat+ids+usage" else chat(return_token_ids=True, **body)
    frames = StreamFrames(OutputRules(sampling, sampling.n, 3, EOS, lambda ids: ""), make())
    frames.start([event("a", [1])])
    frames.frames([event("b", [2])])
    assert frames._template is None


def test_cumulative_sglang_streams_take_the_general_path():
    sampling, make = FORMATS["chat+ids"]()
    batches = [[event("a", [1])], [event("ab", [1, 2])], [event("abc", [1, 2, 3], STOP_EOS)]]
    assert_same_bytes(sampling, make, batches, templated=False, incremental=False)


def test_a_model_name_holding_the_probe_takes_the_general_path():
    sampling, make = chat(model=TEXT_PROBE, return_token_ids=True)
    assert_same_bytes(sampling, make, words(4) + [[ENDINGS["eos"]]], templated=False)


@pytest.mark.parametrize("stop,include,last", [((), False, "tail STOP!"), (("STOP!",), False, "tail STOP!"),
                                               (("STOP!",), True, "tail STOP!"), (("STOP!",), False, "")])
def test_long_choices_drop_sent_text_with_the_same_outputs(monkeypatch, stop, include, last):
    """Past _COMPACT_AT sent characters an incremental choice drops its sent head (keeping the longest
    stop string's length): the outputs equal those of rules that keep everything, also when the stop
    string came before the event that reports it."""
    body = {"stop": list(stop), "include_stop_str_in_output": include}
    sampling = chat(**body)[0]
    events = [event(WORDS[i % len(WORDS)] + "\ufffd" * (i % 3 == 0), [i]) for i in range(3000)]
    if not last:
        events.append(event("tail STOP!", [2999]))
    events.append(event(last, [3000], {"type": "stop", "matched": "STOP!"} if stop else STOP_EOS))

    def outputs(compact_at):
        monkeypatch.setattr(output_rules_module, "_COMPACT_AT", compact_at)
        rules = OutputRules(sampling, 1, 3, EOS, lambda ids: "")
        return [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for e in events
                if (o := rules.feed(e)) is not None], rules

    kept, _ = outputs(10**9)
    dropped, rules = outputs(0)
    assert dropped == kept
    assert len(rules._choices[0].text) < 200  # what is left of ~30,000 characters
    if last:
        assert "".join(text for text, *_ in kept).endswith("tail" + (" STOP!" if include or not stop else " "))
