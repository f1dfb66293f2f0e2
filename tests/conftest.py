"""Shared fixtures: a real Qwen2 BPE tokenizer built offline (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from token_proxy.tokenization.builtin import ensure_builtin_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The built-in Qwen2.5-layout tokenizer with a ChatML template (built once per session)."""
    return ensure_builtin_tokenizer(tmp_path_factory.getbasetemp() / "qwen2-tokenizer")


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))
