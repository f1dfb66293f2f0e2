"""A tiktoken twin of a Hugging Face byte-level BPE tokenizer, built only where it is proven to give the same
ids on ASCII text (about 4x less CPU per encode than tokenizers' own, and it releases the GIL too).

Why each condition (tokenizer.json read through `backend_tokenizer.to_str()`):
- the model is plain byte-level BPE (no dropout, byte fallback, subword prefix or word suffix), with every
  single byte in the vocabulary, so both engines start from the same bytes;
- the normalizer is none or NFC (the identity on ASCII) and the pre-tokenizer is one Split regex (isolated)
  then ByteLevel without its own regex, or a lone ByteLevel with GPT-2's regex: tiktoken's `pat_str`;
  tiktoken keeps only the regex's matches, HF also the gaps between them: the corpus check covers that;
- added tokens: no lstrip/rstrip/single_word (tiktoken has none), none inside another (tiktoken takes the
  leftmost-first special, HF the leftmost-longest) and no two that can overlap in a text (HF matches the
  unnormalized ones in a pass before the normalized ones, tiktoken the leftmost);
- merges: HF merges the adjacent pair listed first, tiktoken the pair whose concatenation has the smallest
  id. They agree when every merge's result id grows with the merge's place, and every split of a token into
  two tokens is a listed merge (else tiktoken could merge a pair HF never does);
- tiktoken takes a piece that is a token whole, HF merges it: every ASCII token must come back whole from
  tokenizers' own BPE (at the model level: a fifth of the cost of encoding the vocabulary as text);
- then a corpus of chat-like text, every ASCII character in context included, must encode to the same ids.
Only ASCII text takes the twin (renderer.text_encoder): NFC is the identity there, both regex engines agree on
the classes of ASCII characters (the corpus holds all 128 in context), and an ASCII word only ever meets ASCII
tokens and merges, so the merge and token checks cover those alone (94k of the test vocabulary's 151k).
Left open by the static conditions: two different merges making one token that overlap in a word (x+y and
y+z, the same token) are tied, and the engines break the tie differently (merge order, leftmost); 257k
tie-prone and random-token ASCII strings gave 0 differences on the test vocabulary (RESULTS §11).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

log = logging.getLogger(__name__)

# GPT-2's pre-tokenizer regex: what a ByteLevel pre-tokenizer with use_regex uses (tokenizers' byte_level.rs).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@dataclass(frozen=True, slots=True)
class FastBpe:
    """The proven twin: `encode(text)` gives HF's ids for ASCII text without add_special_tokens; with them
    too where `adds_nothing` (the post-processor adds no ids)."""

    encode: Callable[[str], list[int]]
    adds_nothing: bool
    timings: tuple[tuple[str, float], ...]


def byte_level_alphabet() -> dict[str, int]:
    """ByteLevel's printable stand-in character → the byte it stands for (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable)), 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return {chr(char): byte for byte, char in chars.items()}


def model_refusal(model: dict) -> str | None:
    if model.get("type") != "BPE":
        return f"the model is {model.get('type')}, not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"the BPE model sets {key}"
    if model.get("byte_fallback"):
        return "the BPE model sets byte_fallback"
    return None


def normalizer_refusal(normalizer: dict | None) -> str | None:
    if normalizer is None or normalizer.get("type") == "NFC":
        return None
    return f"the normalizer is {normalizer.get('type')}, not none or NFC"


def split_pattern(pre_tokenizer: dict | None) -> tuple[str | None, str | None]:
    """(the regex tiktoken must use, None) or (None, the reason there is none)."""
    def byte_level(step: dict, use_regex: bool) -> bool:
        return (step.get("type") == "ByteLevel" and not step.get("add_prefix_space")
                and bool(step.get("use_regex", True)) == use_regex)

    if pre_tokenizer is not None and byte_level(pre_tokenizer, True):
        return GPT2_PATTERN, None
    steps = (pre_tokenizer or {}).get("pretokenizers") if (pre_tokenizer or {}).get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None, "the pre-tokenizer is not Split + ByteLevel or a lone ByteLevel"
    split, last = steps
    pattern = (split.get("pattern") or {}).get("Regex")
    if (split.get("type") != "Split" or pattern is None or split.get("behavior") != "Isolated"
            or split.get("invert")):
        return None, "the pre-tokenizer's first step is not an isolating Split on a regex"
    if not byte_level(last, False):
        return None, "the pre-tokenizer's second step is not ByteLevel without regex or prefix space"
    return pattern, None


def added_tokens_refusal(added_tokens: list[dict]) -> str | None:
    for token in added_tokens:
        for key in ("lstrip", "rstrip", "single_word"):
            if token.get(key):
                return f"the added token {token['content']!r} sets {key}"
    contents = sorted((token["content"] for token in added_tokens), key=len)
    for i, inner in enumerate(contents):
        for outer in contents[i + 1:]:
            if inner in outer:
                return f"the added token {inner!r} is inside {outer!r}"
    # Two that can overlap in a text ("Qxa" and "xaZ" in "QxaZ"): tokenizers matches the unnormalized ones in a
    # pass of their own before the normalized ones, tiktoken takes the leftmost; they may then split differently.
    for first in contents:
        for second in contents:
            if first != second and any(first.endswith(second[:n]) for n in range(1, min(len(first), len(second)))):
                return f"the added tokens {first!r} and {second!r} can overlap"
    return None


def merge_pairs(merges: list) -> list[tuple[str, str]]:
    """tokenizer.json's merges, in either form ("a b" or ["a", "b"])."""
    if merges and isinstance(merges[0], list):
        return list(map(tuple, merges))
    return [tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge) for merge in merges]


def byte_translation(alphabet: dict[str, int]) -> dict[int, str]:
    """str.translate's table: a byte-level token → its bytes as latin-1 characters."""
    return {ord(char): chr(byte) for char, byte in alphabet.items()}


def ascii_tokens(vocab: dict[str, int], alphabet: dict[str, int]) -> set[str]:
    """The byte-level tokens whose bytes are all ASCII: the only ones an ASCII text's pieces are made of."""
    stand_ins = "".join(char for char, byte in alphabet.items() if byte < 128)
    return {token for token in vocab if not token.strip(stand_ins)}


def merge_order_refusal(vocab: dict[str, int], pairs: list[tuple[str, str]], ascii_only: set[str]) -> str | None:
    """Every merge's result is in the vocabulary, and the id of an ASCII merge's result never falls as the
    merges go on (an ASCII word only ever meets ASCII merges, so only their order matters)."""
    last = -1
    for left, right in pairs:
        merged = left + right
        merged_id = vocab.get(merged)
        if merged_id is None:
            return f"the merge {left!r} + {right!r} makes no vocabulary token"
        if merged in ascii_only:
            if merged_id < last:
                return f"the merge {left!r} + {right!r} makes id {merged_id}, below an earlier merge's {last}"
            last = merged_id
    return None


def missing_merge_refusal(pairs: list[tuple[str, str]], ascii_only: set[str]) -> str | None:
    """Every split of an ASCII vocabulary token into two vocabulary tokens is a listed merge."""
    listed = set(pairs)
    for token in ascii_only:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ascii_only and right in ascii_only and (left, right) not in listed:
                return f"the token {token!r} splits into {left!r} + {right!r}, which is not a merge"
    return None


def vocab_refusal(vocab: dict[str, int], alphabet: dict[str, int]) -> str | None:
    """Every vocabulary token is made of ByteLevel's characters, and every byte is a token."""
    strangers = set("".join(vocab)) - alphabet.keys()
    if strangers:
        return f"the vocabulary has tokens that are not byte-level (e.g. with {min(strangers)!r})"
    missing = [char for char in alphabet if char not in vocab]
    return f"the byte {alphabet[missing[0]]} is not a vocabulary token" if missing else None


def static_refusal(spec: dict, timings: list[tuple[str, float]], ascii_only: set[str]) -> str | None:
    """The first reason the twin cannot be proven from tokenizer.json alone (None: all conditions hold);
    `ascii_only` is filled with the vocabulary's ASCII tokens."""
    model, alphabet = spec.get("model") or {}, byte_level_alphabet()
    vocab = model.get("vocab") or {}
    pairs = _timed(timings, "merges as pairs", merge_pairs, model.get("merges") or [])
    checks = (
        ("model", lambda: model_refusal(model)),
        ("normalizer", lambda: normalizer_refusal(spec.get("normalizer"))),
        ("pre-tokenizer", lambda: split_pattern(spec.get("pre_tokenizer"))[1]),
        ("added tokens", lambda: added_tokens_refusal(spec.get("added_tokens") or [])),
        ("vocabulary", lambda: vocab_refusal(vocab, alphabet) or ascii_only.update(ascii_tokens(vocab, alphabet))),
        ("merge order", lambda: merge_order_refusal(vocab, pairs, ascii_only)),
        ("every split a merge", lambda: missing_merge_refusal(pairs, ascii_only)),
    )
    for name, check in checks:
        start = time.process_time()
        reason = check()
        timings.append((name, time.process_time() - start))
        if reason:
            return reason
    return None


def tiktoken_encoding(spec: dict):
    """The tiktoken Encoding of a tokenizer.json that passed `static_refusal`."""
    import tiktoken

    table = byte_translation(byte_level_alphabet())
    ranks = {token.translate(table).encode("latin-1"): token_id for token, token_id in spec["model"]["vocab"].items()}
    specials = {token["content"]: token["id"] for token in spec.get("added_tokens") or []}
    pattern = split_pattern(spec.get("pre_tokenizer"))[0]
    return tiktoken.Encoding("token-proxy-twin", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


def proof_corpus() -> list[str]:
    """Chat-template-like ASCII text, and every ASCII character between letters, digits, spaces and newlines."""
    chat = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            "What's 12345 + 678? I'd say it's 13023, isn't it?? Let's check: 12,345.00 - $678 = ...\n\n"
            "```python\ndef f(x):\n    return x**2  # square\n\tif x  >=  10:\n        print('hi')\n```\n"
            "   leading spaces, trailing spaces   \n\n\n\r\n\r\nCRLF lines\r\n<think>\n\n</think>\n\n"
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
            "<|im_end|>\n<|im_start|>assistant\nOK.<|endoftext|>I'M SHOUTING'S 'LL 've 'Re\n")
    chars = [chr(code) for code in range(128)]
    contexts = [f"a{c}b {c}{c} 1{c}2\n{c}\n\n{c} x{c}{c}{c}y  {c}  '{c}s {c}" for c in chars]
    return [chat, chat * 3, "".join(chars), *contexts, " ".join(contexts), "\n".join(contexts)]


def unreachable_tokens(model, tokens: set[str]) -> list[str]:
    """The tokens tokenizers' BPE does not merge back into themselves from their bytes (tiktoken takes a
    piece that is a token whole): at the model level, one call a token, with no regex or added-token pass
    (a fifth of the cost of encoding them as text)."""
    return [token for token in tokens if len(model.tokenize(token)) != 1]


def first_difference(hf_encode: Callable[[str], list[int]], fast: Callable[[str], list[int]], texts: list[str],
                     separator: str | None) -> str | None:
    """The first text the two encode differently (None: none). With a separator (an added token: both
    engines encode the text between two added tokens on its own), all texts in one call each, then one by
    one only to name a difference."""
    if separator is not None and not any(separator in text for text in texts):
        joined = separator.join(texts)
        if fast(joined) == hf_encode(joined):
            return None
    for text in texts:
        ids, mine = hf_encode(text), fast(text)
        if mine != ids:
            return f"{text[:40]!r} encodes to {mine[:8]} here, {ids[:8]} in tokenizers"
    return None


def load_fast_bpe(tokenizer) -> FastBpe | None:
    """`build_fast_bpe`, its line logged (start-up, in the tokenizer thread)."""
    fast, line = build_fast_bpe(tokenizer)
    log.info(line)
    return fast


def build_fast_bpe(tokenizer) -> tuple[FastBpe | None, str]:
    """The proven twin of `tokenizer` (a transformers tokenizer with a Rust backend), or None; and a line
    saying which and why, with each check's seconds."""
    timings: list[tuple[str, float]] = []
    # The cyclic collector paused: the proof makes ~10^6 long-lived objects (tokenizer.json's lists, the
    # merges, the ranks), and its passes over them were a third of the time. Nothing here makes cycles.
    collecting = gc.isenabled()
    gc.disable()
    try:
        fast, reason = _build(tokenizer, timings)
    except Exception as exc:  # noqa: BLE001 -- a tokenizer.json this proof did not foresee: tokenizers encodes
        fast, reason = None, f"the proof failed on this tokenizer ({type(exc).__name__}: {str(exc)[:200]})"
    finally:
        if collecting:
            gc.enable()
    spent = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in timings)
    if fast is None:
        return None, f"tokenizers encodes prompts (no tiktoken twin: {reason}; {spent})"
    return FastBpe(fast.encode, fast.adds_nothing, tuple(timings)), f"tiktoken encodes ASCII prompts ({spent})"


def _timed(timings: list[tuple[str, float]], name: str, fn, *args):
    start = time.process_time()
    result = fn(*args)
    timings.append((name, time.process_time() - start))
    return result


def _build(tokenizer, timings: list[tuple[str, float]]) -> tuple[FastBpe | None, str]:
    try:
        import tiktoken  # noqa: F401 -- optional: without it, tokenizers encodes everything
    except ImportError as exc:
        return None, f"tiktoken cannot be imported ({exc})"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, "the tokenizer has no Rust backend"
    spec = _timed(timings, "read tokenizer.json", lambda: orjson.loads(backend.to_str()))
    ascii_only: set[str] = set()
    reason = static_refusal(spec, timings, ascii_only)
    if reason:
        return None, reason
    try:
        encoding = _timed(timings, "build tiktoken", tiktoken_encoding, spec)
    except Exception as exc:  # noqa: BLE001 -- tiktoken refuses the regex or ranks: tokenizers encodes
        return None, f"tiktoken refused it ({' '.join(str(exc).split())[:200]})"
    specials = encoding.special_tokens_set
    encode_text = encoding.encode

    def encode(text: str) -> list[int]:
        return encode_text(text, allowed_special="all", disallowed_special=())

    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)

    def hf_ids(text: str) -> list[int]:
        return encode_batch([text], add_special_tokens=False)[0].ids

    unbuilt = _timed(timings, "every ASCII token rebuilt", unreachable_tokens, backend.model, ascii_only)
    if unbuilt:
        return None, f"tokenizers' BPE does not rebuild the token {min(unbuilt)!r} from its bytes"
    reason = _timed(timings, "the corpus", first_difference, hf_ids, encode, proof_corpus(),
                    min(specials, key=len, default=None))
    if reason:
        return None, reason
    sample = proof_corpus()[0]
    adds_nothing = _timed(timings, "post-processor", lambda: encode_batch([sample], add_special_tokens=True)[0].ids
                          == encode_batch([sample], add_special_tokens=False)[0].ids)
    return FastBpe(encode, adds_nothing, ()), ""
