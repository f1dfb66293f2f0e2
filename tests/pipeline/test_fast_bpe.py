"""The tiktoken twin (tokenization/fast_bpe.py): the ids of the tokenizer over the whole test vocabulary and a
corpus, which text takes it (ASCII only, special tokens not split, nothing added), and every reason it is
refused, on tiny tokenizer.json variants built here."""

from __future__ import annotations

import copy
import json
import random
import sys

import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from token_proxy.cli import parse_settings
from token_proxy.tokenization import ChatPrompt, PromptRenderer, fast_bpe
from token_proxy.tokenization.fast_bpe import (
    GPT2_PATTERN,
    FastBpe,
    added_tokens_refusal,
    build_fast_bpe,
    byte_level_alphabet,
    first_difference,
    merge_order_refusal,
    merge_pairs,
    missing_merge_refusal,
    model_refusal,
    normalizer_refusal,
    proof_corpus,
    split_pattern,
)
from token_proxy.tokenization.renderer import render_chat_text, text_encoder

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")


class Spy:
    """A twin's encode that counts its calls."""

    def __init__(self, encode):
        self.encode, self.calls = encode, 0

    def __call__(self, text):
        self.calls += 1
        return self.encode(text)


def spied(fast: FastBpe, adds_nothing: bool | None = None) -> tuple[FastBpe, Spy]:
    spy = Spy(fast.encode)
    return FastBpe(spy, fast.adds_nothing if adds_nothing is None else adds_nothing, fast.timings), spy


@pytest.fixture
def hf_fast_bpe(hf_fast_bpe, hf_tokenizer):
    """The session's twin, which must exist here (tiktoken is a dependency)."""
    assert hf_fast_bpe is not None, build_fast_bpe(hf_tokenizer)[1]
    return hf_fast_bpe


def tiny_spec() -> dict:
    """A byte-level BPE tokenizer.json in Qwen2's layout: the 256 bytes, four merges, two added tokens."""
    alphabet = byte_level_alphabet()
    vocab = dict(sorted(alphabet.items(), key=lambda item: item[1]))
    merges = [["h", "e"], ["l", "l"], ["he", "ll"], ["hell", "o"]]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    added = [{"id": 260 + i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, content in enumerate(["<|endoftext|>", "<|im_start|>"])]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def tiny_tokenizer(spec: dict) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


def refusal(spec: dict) -> str:
    fast, line = build_fast_bpe(tiny_tokenizer(spec))
    assert fast is None, line
    return line.split("no tiktoken twin: ", 1)[1].split(";", 1)[0]


def random_ascii_texts(count: int, seed: int = 7) -> list[str]:
    pieces = ["the", " The", "  ", "\n", "\n\n", "\t", " 123", "4567", "'s", "'LL", " don't", "!!", "?", "...",
              "```", "{\"a\": 1}", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "\r\n", "   x",
              "x_y", "__init__", "http://a.b/c?d=e", "$", "%", "^", "~", "|", "\\", "`", "\x00", "\x1f", "\x7f",
              "\x0b", "\x0c", " ", "A", "Z", "0", "9", "-", "=", "==>", "i++", "a.b", "e.g."]
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 60))) for _ in range(count)]


def test_the_twin_gives_the_tokenizers_ids_over_the_whole_vocabulary_and_a_corpus(hf_tokenizer, hf_fast_bpe):
    """Every vocabulary entry as text (joined by an added token, which both encode around), the proof
    corpus, rendered chats and random chat-like ASCII text: the ids of transformers' encode."""
    decoder = byte_level_alphabet()
    table = {ord(char): chr(byte) for char, byte in decoder.items()}
    vocab = hf_tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    texts = [token.translate(table).encode("latin-1").decode("utf-8", "replace") for token in vocab]
    ascii_texts = [text for text in texts if text.isascii()]
    assert len(vocab) == 151643 and len(ascii_texts) > 90000
    joined = "<|endoftext|>".join(ascii_texts)
    assert hf_fast_bpe.encode(joined) == hf_tokenizer.encode(joined, add_special_tokens=False)
    encode = text_encoder(hf_tokenizer, hf_fast_bpe)
    chats = [render_chat_text(hf_tokenizer, ChatPrompt([{"role": "user", "content": text}])) for text in
             random_ascii_texts(50, seed=3)]
    for text in [*proof_corpus(), *chats, *random_ascii_texts(1500)]:
        assert encode(text, False) == hf_tokenizer.encode(text, add_special_tokens=False), text
    assert encode("hello world", False) == [14990, 1879]


def test_only_ascii_text_takes_the_twin(hf_tokenizer, hf_fast_bpe):
    fast, spy = spied(hf_fast_bpe)
    encode = text_encoder(hf_tokenizer, fast)
    assert encode("plain ASCII\n", False) == hf_tokenizer.encode("plain ASCII\n", add_special_tokens=False)
    assert spy.calls == 1
    for text in ["naïve café", "東京 🙂", "a\u00a0b", "x\u2028y"]:
        assert encode(text, False) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert spy.calls == 1


def test_special_tokens_in_text_get_the_tokenizers_ids(hf_tokenizer, hf_fast_bpe):
    fast, spy = spied(hf_fast_bpe)
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|endoftext|>"
    ids = text_encoder(hf_tokenizer, fast)(text, False)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids[:2] == [151644, 872] and ids[-1] == 151643 and spy.calls == 1


def test_split_special_tokens_never_takes_the_twin(hf_tokenizer, hf_fast_bpe):
    tokenizer = copy.deepcopy(hf_tokenizer)
    tokenizer.split_special_tokens = True
    fast, spy = spied(hf_fast_bpe)
    ids = text_encoder(tokenizer, fast)("<|im_start|>user", False)
    assert ids == tokenizer.encode("<|im_start|>user", add_special_tokens=False) and len(ids) > 2
    assert spy.calls == 0


def test_a_bos_adding_post_processor_sends_add_special_tokens_to_the_tokenizer():
    spec = tiny_spec()
    tokenizer = tiny_tokenizer(spec)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 260)])
    built, line = build_fast_bpe(tokenizer)
    assert built is not None, line
    assert built.adds_nothing is False
    fast, spy = spied(built)
    encode = text_encoder(tokenizer, fast)
    assert encode("hello", True) == [260, 259] and spy.calls == 0
    assert encode("hello", False) == [259] and spy.calls == 1


def test_the_tiny_tokenizer_gets_a_twin_that_adds_nothing():
    tokenizer = tiny_tokenizer(tiny_spec())
    built, line = build_fast_bpe(tokenizer)
    assert built is not None, line
    assert line.startswith("tiktoken encodes ASCII prompts (read tokenizer.json ")
    assert [name for name, _ in built.timings] == [
        "read tokenizer.json", "merges as pairs", "model", "normalizer", "pre-tokenizer", "added tokens", "vocabulary", "merge order",
        "every split a merge", "build tiktoken", "every ASCII token rebuilt", "the corpus", "post-processor"]
    assert built.adds_nothing is True
    fast, spy = spied(built)
    assert text_encoder(tokenizer, fast)("hello<|im_start|> hello", True) == [259, 261, 32, 259]  # the tiny vocabulary: id = byte
    assert spy.calls == 1


def with_changes(change) -> dict:
    spec = tiny_spec()
    change(spec)
    return spec


def test_each_static_condition_refuses_with_its_reason():
    def set_added(key):
        return lambda spec: spec["added_tokens"][1].__setitem__(key, True)

    cases = [
        (set_added("lstrip"), "the added token '<|im_start|>' sets lstrip"),
        (set_added("rstrip"), "the added token '<|im_start|>' sets rstrip"),
        (set_added("single_word"), "the added token '<|im_start|>' sets single_word"),
        (lambda spec: spec["model"].__setitem__("byte_fallback", True), "the BPE model sets byte_fallback"),
        (lambda spec: spec["model"].__setitem__("dropout", 0.1), "the BPE model sets dropout"),
        (lambda spec: spec["normalizer"].__setitem__("type", "NFKC"), "the normalizer is NFKC, not none or NFC"),
        (lambda spec: spec["pre_tokenizer"]["pretokenizers"][0].__setitem__("behavior", "Removed"),
         "the pre-tokenizer's first step is not an isolating Split on a regex"),
        (lambda spec: spec["pre_tokenizer"]["pretokenizers"][1].__setitem__("add_prefix_space", True),
         "the pre-tokenizer's second step is not ByteLevel without regex or prefix space"),
        (lambda spec: spec["added_tokens"].append({**spec["added_tokens"][1], "id": 262, "content": "<|im"}),
         "the added token '<|im' is inside '<|im_start|>'"),
        # "|>Q" and '<|im_start|>' share "|>" in "<|im_start|>Q": tokenizers and tiktoken may split it apart
        (lambda spec: spec["added_tokens"].append({**spec["added_tokens"][1], "id": 262, "content": "|>Q"}),
         "the added tokens '<|im_start|>' and '|>Q' can overlap"),
        (lambda spec: spec["model"]["vocab"].update({"he": 258, "hell": 256}),
         "the merge 'l' + 'l' makes id 257, below an earlier merge's 258"),
        (lambda spec: spec["model"]["vocab"].__setitem__("lo", 262),
         "the token 'lo' splits into 'l' + 'o', which is not a merge"),
        (lambda spec: spec["model"]["vocab"].__setitem__("xyz", 262),
         "tokenizers' BPE does not rebuild the token 'xyz' from its bytes"),
    ]
    for change, reason in cases:
        assert refusal(with_changes(change)) == reason


def test_the_pure_checks():
    assert model_refusal({"type": "WordPiece"}) == "the model is WordPiece, not BPE"
    assert model_refusal({"type": "BPE", "continuing_subword_prefix": "##"}) == \
        "the BPE model sets continuing_subword_prefix"
    assert model_refusal({"type": "BPE", "continuing_subword_prefix": "", "end_of_word_suffix": ""}) is None
    assert normalizer_refusal(None) is None and normalizer_refusal({"type": "NFC"}) is None
    assert split_pattern({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}) == (GPT2_PATTERN, None)
    assert split_pattern({"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}) == \
        (None, "the pre-tokenizer is not Split + ByteLevel or a lone ByteLevel")
    assert split_pattern(tiny_spec()["pre_tokenizer"]) == (QWEN_PATTERN, None)
    assert added_tokens_refusal([{"content": "<a>"}, {"content": "<b>"}]) is None
    assert merge_pairs(["a b", "ab c"]) == merge_pairs([["a", "b"], ["ab", "c"]]) == [("a", "b"), ("ab", "c")]
    vocab = {"a": 0, "b": 1, "ab": 2}
    assert merge_order_refusal(vocab, [("a", "c")], set(vocab)) == "the merge 'a' + 'c' makes no vocabulary token"
    assert missing_merge_refusal([], set(vocab)) == "the token 'ab' splits into 'a' + 'b', which is not a merge"
    assert missing_merge_refusal([("a", "b")], set(vocab)) is None
    assert first_difference(lambda t: [len(t)], lambda t: [len(t)], ["x", "y"], "|") is None
    assert first_difference(lambda t: [len(t)], lambda t: [len(t) + ("y" in t)], ["x", "y"], "|") == \
        "'y' encodes to [2] here, [1] in tokenizers"


def test_without_tiktoken_the_tokenizer_encodes(monkeypatch, hf_tokenizer):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    fast, line = build_fast_bpe(hf_tokenizer)
    assert fast is None
    assert line.startswith("tokenizers encodes prompts (no tiktoken twin: tiktoken cannot be imported (")


def test_load_fast_bpe_logs_its_line_once(caplog, hf_tokenizer):
    tokenizer = tiny_tokenizer(tiny_spec())
    with caplog.at_level("INFO", logger=fast_bpe.__name__):
        assert fast_bpe.load_fast_bpe(tokenizer) is not None
    lines = [record.getMessage() for record in caplog.records if record.name == fast_bpe.__name__]
    assert len(lines) == 1 and lines[0].startswith("tiktoken encodes ASCII prompts (")


async def test_the_renderer_renders_and_encodes_through_the_twin(hf_tokenizer, hf_fast_bpe):
    from concurrent.futures import ThreadPoolExecutor

    fast, spy = spied(hf_fast_bpe)
    with ThreadPoolExecutor(1) as executor:
        renderer = PromptRenderer(hf_tokenizer, executor, cache_size=0, busy=lambda: False, fast_bpe=fast)
        prompt = ChatPrompt([{"role": "user", "content": "What is 2+2?"}])
        rendered = await renderer.render_chat(prompt)
        assert rendered.ids == hf_tokenizer.encode(render_chat_text(hf_tokenizer, prompt), add_special_tokens=False)
        assert await renderer.encode("hi there", True) == [6023, 1052]
    assert spy.calls == 2


def test_the_flag_turns_the_twin_off():
    assert parse_settings([]).fast_encoder is True
    assert parse_settings(["--fast-encoder", "false"]).fast_encoder is False
    assert parse_settings([], {"TOKEN_PROXY_FAST_ENCODER": "false"}).fast_encoder is False


@pytest.mark.parametrize("enabled", [True, False])
async def test_start_up_builds_the_twin_only_when_the_flag_is_on(monkeypatch, make_proxy, sim, hf_fast_bpe, enabled):
    from token_proxy.state import CONTEXT

    built = []
    monkeypatch.setattr("token_proxy.sglang.discovery.load_fast_bpe", lambda tokenizer: built.append(1) or hf_fast_bpe)
    proxy = await make_proxy(sim, fast_encoder=enabled)
    assert built == ([1] if enabled else [])
    response = await proxy.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False})
    assert (await response.json())["tokens"] == [14990, 1879]
    assert proxy.app[CONTEXT] is not None


def test_a_tokenizer_json_the_proof_did_not_foresee_falls_back_with_its_reason(monkeypatch, hf_tokenizer):
    """The twin is an optimisation: a proof that raises (an odd tokenizer.json) never stops start-up."""
    def odd(spec, timings, ascii_only):
        raise KeyError("merges")

    monkeypatch.setattr(fast_bpe, "static_refusal", odd)
    fast, line = fast_bpe.build_fast_bpe(hf_tokenizer)
    assert fast is None
    assert line.startswith("tokenizers encodes prompts (no tiktoken twin: the proof failed on this tokenizer "
                           "(KeyError: 'merges');")


def test_a_text_past_the_twins_bound_goes_to_the_tokenizer(hf_tokenizer, hf_fast_bpe):
    """tiktoken's regex engine gives up on a whitespace run of ~1,000,000 characters before a letter (a
    ValueError, which was a 500): a text longer than TWIN_MAX_CHARS is encoded by tokenizers, and a twin
    that raises falls back too."""
    from token_proxy.tokenization.renderer import TWIN_MAX_CHARS

    fast, spy = spied(hf_fast_bpe)
    encode = text_encoder(hf_tokenizer, fast)
    long_run = " " * 1_000_001 + "x"
    expected = hf_tokenizer.backend_tokenizer.encode_batch_fast([long_run], add_special_tokens=False)[0].ids
    assert encode(long_run, False) == expected
    assert spy.calls == 0
    edge = "a" * TWIN_MAX_CHARS
    assert encode(edge, False) == hf_tokenizer.encode(edge, add_special_tokens=False)
    assert spy.calls == 1

    def gives_up(text):
        raise ValueError("Regex error while tokenizing: Max stack size exceeded for backtracking")

    raising = type(hf_fast_bpe)(gives_up, hf_fast_bpe.adds_nothing, ())
    assert text_encoder(hf_tokenizer, raising)("plain text", False) == hf_tokenizer.encode(
        "plain text", add_special_tokens=False)
