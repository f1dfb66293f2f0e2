"""Tool-call formats by vLLM 0.33's `--tool-call-parser` names (aliases as vLLM registers them)."""

from __future__ import annotations

from token_proxy.tools.formats.deepseek_v3 import DeepSeekV3Format
from token_proxy.tools.formats.forced import NamedFormat, RequiredFormat
from token_proxy.tools.formats.hermes import HermesFormat
from token_proxy.tools.formats.llama3 import Llama3JsonFormat
from token_proxy.tools.formats.mistral import MistralFormat
from token_proxy.tools.formats.qwen3_coder import Qwen3CoderFormat
from token_proxy.tools.formats.scan import Scan, ToolFormat

TOOL_PARSERS: dict[str, ToolFormat] = {
    "hermes": HermesFormat(),
    "qwen3_json": HermesFormat(name="qwen3_json"),
    "qwen3_coder": Qwen3CoderFormat(),
    "qwen3_xml": Qwen3CoderFormat(name="qwen3_xml"),
    "llama3_json": Llama3JsonFormat(),
    "llama4_json": Llama3JsonFormat(name="llama4_json"),
    "mistral": MistralFormat(),
    "deepseek_v3": DeepSeekV3Format(),
}

__all__ = ["TOOL_PARSERS", "NamedFormat", "RequiredFormat", "Scan", "ToolFormat"]
