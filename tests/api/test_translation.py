"""Pure translation functions: request -> SGLang payload, SGLang output -> vLLM shapes."""

from __future__ import annotations

import pytest

from token_proxy.api import TokenNamer
from token_proxy.api.chat import parse_chat_request
from token_proxy.api.chat.format import ChatFormatter, PlainText
from token_proxy.api.logprobs import CLAMP, chat_logprob_content, top_row
from token_proxy.errors import InvalidRequest
from token_proxy.pipeline.output_rules import OutputRules, map_finish, proxy_stop_ids
from token_proxy.sglang.payload import generate_payload, resolve_max_tokens
from token_proxy.vocabulary import ResponseMeta

VOCAB = 151665
EOS = 151645
MSGS = [{"role": "user", "content": "hi"}]


def chat(**extra):
    return parse_chat_request({"model": "m", "messages": MSGS, **extra}, VOCAB)


class FakeTexts:
    def text(self, token_id):
        return f"<{token_id}>"


def payload_for(req, prompt_len=10, ctx=100):
    max_new = resolve_max_tokens(req.sampling, prompt_len, ctx)
    return generate_payload(list(range(prompt_len)), req.sampling, max_new, rid="r1", stream=False)


def test_payload_maps_vllm_fields_to_sglang_keys_only():
    req = chat(max_tokens=7, min_tokens=2, temperature=0.5, top_p=0.9, top_k=0, min_p=0.1, seed=3,
               stop="x", stop_token_ids=[5], frequency_penalty=0.5, presence_penalty=-0.5,
               repetition_penalty=1.1, logit_bias={"12": 200}, include_stop_str_in_output=True,
               skip_special_tokens=False, return_token_ids=True, n=1)
    params = payload_for(req)["sampling_params"]
    assert params == {
        "max_new_tokens": 7, "n": 1, "skip_special_tokens": False, "spaces_between_special_tokens": True,
        "min_new_tokens": 2, "stop": ["x"], "no_stop_trim": True, "stop_token_ids": [5],
        "temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.1, "frequency_penalty": 0.5,
        "presence_penalty": -0.5, "repetition_penalty": 1.1, "sampling_seed": 3, "logit_bias": {"12": 100.0},
    }


def test_ignore_eos_with_stop_ids_leaves_the_stop_ids_to_the_proxy():
    req = chat(ignore_eos=True, stop_token_ids=[5, 6])
    params = payload_for(req)["sampling_params"]
    assert params["ignore_eos"] is True and "stop_token_ids" not in params
    assert proxy_stop_ids(req.sampling) == {5, 6}
    assert proxy_stop_ids(chat(stop_token_ids=[5]).sampling) == frozenset()


def test_absent_max_tokens_means_rest_of_context_never_sglangs_128():
    assert payload_for(chat(), prompt_len=10, ctx=100)["sampling_params"]["max_new_tokens"] == 90
    assert payload_for(chat(max_completion_tokens=5))["sampling_params"]["max_new_tokens"] == 5


def test_context_rules_follow_vllm():
    # prompt + max_tokens past the context is clamped, as vLLM does (finish_reason "length")
    assert resolve_max_tokens(chat(max_tokens=95).sampling, 10, 100) == 90
    with pytest.raises(InvalidRequest) as exc:
        resolve_max_tokens(chat(max_tokens=101).sampling, 10, 100)
    assert exc.value.message == ("max_tokens=101 cannot be greater than max_model_len=100. "
                                 "Please request fewer output tokens.")
    assert exc.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as exc:
        resolve_max_tokens(chat().sampling, 101, 100)
    assert exc.value.message.startswith("This model's maximum context length is 100 tokens. However, your "
                                        "prompt contains 101 input tokens")
    with pytest.raises(InvalidRequest) as exc:
        resolve_max_tokens(chat().sampling, 100, 100)
    assert exc.value.param == "max_tokens"


def test_logprob_fields_and_response_format():
    req = chat(logprobs=True, top_logprobs=3,
               response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    body = payload_for(req)
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 3 and body["logprob_start_len"] == -1
    assert body["sampling_params"]["json_schema"] == '{"type":"object"}'


@pytest.mark.parametrize("field,value,param", [
    ("n", 0, "n"), ("n", "2", "n"), ("max_tokens", -1, "max_tokens"), ("max_tokens", 0, "max_tokens"),
    ("temperature", "hot", "temperature"), ("temperature", -1, "temperature"), ("top_p", 0, "top_p"),
    ("top_k", -2, "top_k"), ("stop", [1], "stop"), ("stop_token_ids", [VOCAB], "stop_token_ids"),
    ("stop_token_ids", [-1], "stop_token_ids"), ("logit_bias", {"abc": 1}, "logit_bias"),
    ("use_beam_search", True, "use_beam_search"), ("top_logprobs", 2, "top_logprobs"),
    ("logprobs", "yes", "logprobs"), ("seed", 1.5, "seed"), ("stream", "true", "stream"),
    ("stream_options", {"include_usage": True}, "stream_options"), ("messages", [], "messages"),
    ("messages", [{"role": "wizard", "content": "x"}], "messages"), ("messages", "hi", "messages"),
    ("continue_final_message", True, "continue_final_message"), ("tool_choice", "required", "tool_choice"),
    ("response_format", {"type": "yaml"}, "response_format"), ("min_p", 2, "min_p"),
])
def test_bad_fields_name_the_parameter(field, value, param):
    body = {"model": "m", "messages": MSGS, field: value}
    with pytest.raises(InvalidRequest) as exc:
        parse_chat_request(body, VOCAB)
    assert exc.value.param == param
    assert exc.value.status == 400


def test_text_parts_are_joined_like_vllm():
    req = parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, VOCAB)
    assert req.prompt.messages[0]["content"] == "a\nb"


@pytest.mark.parametrize("finish,eos,expected", [
    ({"type": "stop", "matched": EOS}, EOS, ("stop", None)),
    ({"type": "stop", "matched": 151643}, EOS, ("stop", 151643)),
    ({"type": "stop", "matched": EOS}, None, ("stop", EOS)),
    ({"type": "stop", "matched": "\n\n"}, EOS, ("stop", "\n\n")),
    ({"type": "length", "length": 8}, EOS, ("length", None)),
    ({"type": "abort", "message": "Aborted"}, EOS, ("abort", None)),
    (None, EOS, (None, None)),
])
def test_finish_reason_mapping(finish, eos, expected):
    assert map_finish(finish, eos) == expected


def test_top_logprobs_put_sampled_token_first_and_clamp():
    row = [[-0.1, 7, None], [-0.5, 9, None], [-2.0, 3, None]]
    assert top_row(9, -0.5, row, 2) == [(9, -0.5), (7, -0.1)]
    assert top_row(7, -0.1, row, 3) == [(7, -0.1), (9, -0.5), (3, -2.0)]
    assert top_row(7, -0.1, row, 0) == []
    content = chat_logprob_content([[float("-inf"), 7, None]], [row], 1, TokenNamer(FakeTexts(), as_ids=True))
    # vLLM quirk kept: the sampled entry's bytes are its decoded text's, the top entries' their token string's
    assert content == [{"token": "token_id:7", "logprob": CLAMP, "bytes": list(b"<7>"),
                        "top_logprobs": [{"token": "token_id:7", "logprob": CLAMP, "bytes": list(b"token_id:7")}]}]


class ChatStream:
    """The output rules and the chat formatter, as the stream relay drives them."""

    def __init__(self, req, incremental):
        meta = ResponseMeta(response_id="chatcmpl-1", created=1, model="m", prompt_ids=[[1, 2]])
        self.rules = OutputRules(req.sampling, req.sampling.n, 2, EOS, lambda ids: "", incremental)
        self.formatter = ChatFormatter(req, meta, TokenNamer(FakeTexts(), False))
        self.start = self.formatter.start

    def feed(self, event):
        out = self.rules.feed(event)
        return [] if out is None else [self.formatter.chunk(out)]

    def finish(self):
        return self.formatter.finish(self.rules.usage())

    @property
    def done(self):
        return self.rules.done


def _translator(incremental, **extra):
    return ChatStream(chat(stream=True, return_token_ids=True, **extra), incremental)


def _event(text, ids, finish=None, **meta):
    return {"text": text, "output_ids": ids, "meta_info": {"finish_reason": finish,
                                                           "completion_tokens": meta.pop("n", len(ids)), **meta}}


CUMULATIVE = [_event("a", [10]), _event("ab", [10, 11]), _event("ab\ufffd", [10, 11, 12]),
              _event("abé", [10, 11, 12, 13]), _event("abé", [10, 11, 12, 13, EOS], {"type": "stop", "matched": EOS})]
INCREMENTAL = [_event("a", [10]), _event("b", [11]), _event("", [12], n=3), _event("é", [13], n=4),
               _event("", [EOS], {"type": "stop", "matched": EOS}, n=5)]


@pytest.mark.parametrize("incremental,events", [(False, CUMULATIVE), (True, INCREMENTAL)])
def test_stream_deltas_are_the_same_in_both_sglang_modes(incremental, events):
    tr = _translator(incremental)
    start = tr.start()
    assert start[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert start[0]["prompt_token_ids"] == [1, 2]
    chunks = [c for e in events for c in tr.feed(e)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"content": "a"}, {"content": "b"}, {"content": ""}, {"content": "é"}, {"content": ""}]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[10], [11], [12], [13], [EOS]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] is None
    assert tr.done


def test_stream_holds_back_possible_stop_string_prefix():
    tr = _translator(False, stop=["xyz"])
    tr.start()
    out = tr.feed(_event("abcxy", [1, 2]))
    assert out[0]["choices"][0]["delta"] == {"content": "abc"}
    out = tr.feed(_event("abc", [1, 2, 3], {"type": "stop", "matched": "xyz"}))
    assert out[0]["choices"][0]["delta"] == {"content": ""}
    assert out[0]["choices"][0]["stop_reason"] == "xyz"


def test_usage_chunk_when_asked():
    tr = _translator(True, stream_options={"include_usage": True})
    tr.start()
    tr.feed(_event("a", [5], {"type": "length", "length": 1}, cached_tokens=1))
    (chunk,) = tr.finish()
    assert chunk["choices"] == []
    assert chunk == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [], "usage": {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1,
                                              "prompt_tokens_details": {"cached_tokens": 1}}}


def test_stream_chunk_keys_follow_vllms_exclude_unset():
    tr = _translator(False)
    (role,) = tr.start()
    assert list(role) == ["id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"]
    assert list(role["choices"][0]) == ["index", "delta", "logprobs", "finish_reason"]
    (content,) = tr.feed(_event("a", [10]))
    assert list(content) == ["id", "object", "created", "model", "choices", "kv_transfer_params"]
    assert list(content["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "token_ids"]
    (last,) = tr.feed(_event("ab", [10, 11], {"type": "length", "length": 2}))
    assert list(last) == ["id", "object", "created", "model", "choices", "system_fingerprint", "kv_transfer_params"]
    assert list(last["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids",
                                        "weight_versions"]
    assert last["choices"][0]["delta"] == {"content": "b"}


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


class ToolCallParser(PlainText):
    """A stand-in for a tool-call parser plugged into the chat formatter's output-parser hook."""

    def message(self, text):
        return {"content": "", "tool_calls": [TOOL_CALL]} if text.startswith("<tool>") else {"content": text}

    def delta(self, index, text, finished):
        return {"tool_calls": [TOOL_CALL]} if text.startswith("<tool>") else {"content": text}


def test_output_parser_hook_shapes_message_and_finish_reason_in_both_modes():
    req = chat(stream=True)
    meta = ResponseMeta(response_id="chatcmpl-1", created=1, model="m", prompt_ids=[[1, 2]])
    formatter = ChatFormatter(req, meta, TokenNamer(FakeTexts(), False), ToolCallParser())
    rules = OutputRules(req.sampling, 1, 2, EOS, lambda ids: "", incremental=True)
    (whole,) = rules.whole([_event("<tool>f()", [5, 6], {"type": "stop", "matched": EOS})])
    choice = formatter.response([whole], rules.usage())["choices"][0]
    assert choice["message"]["tool_calls"] == [TOOL_CALL]
    assert choice["finish_reason"] == "tool_calls"
    stream_rules = OutputRules(req.sampling, 1, 2, EOS, lambda ids: "", incremental=True)
    first = formatter.chunk(stream_rules.feed(_event("<tool>f()", [5, 6])))
    last = formatter.chunk(stream_rules.feed(_event("", [EOS], {"type": "stop", "matched": EOS})))
    assert first["choices"][0]["delta"] == {"tool_calls": [TOOL_CALL]}
    assert last["choices"][0]["finish_reason"] == "tool_calls"
