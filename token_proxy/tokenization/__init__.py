"""The served tokenizer: loading it and describing it (loader.py), rendering chat prompts to ids with a
cache (renderer.py), its tiktoken twin for ASCII text, proven equal at start-up (fast_bpe.py), and token ids
to texts (token_text.py). Pure: it knows nothing of the app."""

from token_proxy.tokenization.loader import TokenizerInfo, describe_tokenizer, load_tokenizer
from token_proxy.tokenization.renderer import ChatPrompt, PromptRenderer
from token_proxy.tokenization.token_text import TokenTexts

__all__ = ["ChatPrompt", "PromptRenderer", "TokenTexts", "TokenizerInfo", "describe_tokenizer", "load_tokenizer"]
