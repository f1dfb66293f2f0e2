"""Loading the HF tokenizer once, and what the proxy needs to know about it."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """Facts read once from the tokenizer, so hot paths never ask it again."""

    vocab_size: int  # len(tokenizer): valid input ids are 0..vocab_size-1
    eos_token_id: int | None  # the tokenizer's: vLLM reports stop_reason null for it


# What a model directory holds when it carries a tokenizer (a fast tokenizer, a sentencepiece model, or
# a BPE/WordPiece vocabulary): a directory with none of them is the wrong directory, whatever
# transformers then guesses (it suggests installing sentencepiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def tokenizer_dir_problem(path: str) -> str | None:
    """One line naming the fix when `path` is a local directory that holds no tokenizer; else None."""
    directory = os.path.expanduser(path)
    if not os.path.isdir(directory) or any(os.path.exists(os.path.join(directory, f)) for f in TOKENIZER_FILES):
        return None
    return (f"the tokenizer directory {path!r} holds no tokenizer (no tokenizer.json, tokenizer_config.json "
            "or tokenizer.model): pass --tokenizer with the model's directory (the one SGLang's --model-path names)")


def unseen_path_problem(path: str) -> str | None:
    """One line when the tokenizer path SGLang reports is a local path that does not exist here: the proxy
    runs in another container or on another host than SGLang, and transformers would take it for a hub id
    ("Repo id must be ...")."""
    if not path.startswith(("/", "~", "./", "../")) or os.path.exists(os.path.expanduser(path)):
        return None
    parent = os.path.dirname(path.rstrip("/")) or path
    return (f"SGLang reports its tokenizer at {path!r}, which does not exist where the proxy runs (another "
            f"container or host): mount that directory at the same path (docker run -v {parent}:{parent}:ro, or a "
            "compose volume), or pass --tokenizer with a local copy or the model's Hugging Face id")


def load_tokenizer(name_or_path: str):
    """Load a fast HF tokenizer; offline when the path is local, so nothing is downloaded by surprise."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    local = os.path.isdir(name_or_path)
    log.info("loading tokenizer %s (%s)", name_or_path, "local" if local else "hub id")
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local, trust_remote_code=False)
    if not getattr(tokenizer, "is_fast", False):
        log.warning("tokenizer %s is not a fast tokenizer: tokenization will be slow", name_or_path)
    return tokenizer


def describe_tokenizer(tokenizer) -> TokenizerInfo:
    return TokenizerInfo(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
    )
