"""sglang-token-proxy: vLLM's OpenAI-compatible API, token ids included, in front of SGLang."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("sglang-token-proxy")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
