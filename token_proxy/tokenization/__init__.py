"""The served tokenizer: loading it and describing it (loader.py), rendering chat prompts to ids with a
cache (renderer.py), its tiktoken twin for ASCII text, proven equal at start-up (fast_bpe.py), and token ids
to texts (token_text.py). Pure: it knows nothing of the app."""

from token_proxy.faces import door

__all__ = ["ChatPrompt", "PromptRenderer", "TokenTexts", "TokenizerInfo", "describe_tokenizer", "load_tokenizer"]

__getattr__ = door(__name__, {
    "ChatPrompt": "renderer",
    "PromptRenderer": "renderer",
    "TokenTexts": "token_text",
    "TokenizerInfo": "loader",
    "describe_tokenizer": "loader",
    "load_tokenizer": "loader",
})
