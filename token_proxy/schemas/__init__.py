"""Request parsing, SGLang payloads, the output rules and response formatting: pure functions.

The names here are the package's public API (tests and other packages import them from here).
"""

from token_proxy.schemas.chat_format import PLAIN_TEXT, ChatFormatter, ChatOutputParser, PlainText
from token_proxy.schemas.chat_request import ChatRequest, parse_chat_request
from token_proxy.schemas.completion_format import CompletionFormatter
from token_proxy.schemas.completion_request import CompletionRequest, parse_completion_request
from token_proxy.schemas.generate_format import GenerateFormatter
from token_proxy.schemas.generate_tokens import GenerateTokensRequest, parse_generate_tokens
from token_proxy.schemas.logprobs import CLAMP, TokenNamer, chat_logprob_content, top_row
from token_proxy.schemas.output_rules import Output, OutputRules, ResponseMeta, Usage, map_finish
from token_proxy.schemas.sampling import SamplingRequest, parse_sampling
from token_proxy.schemas.sglang_payload import (
    SGLangRequest,
    generate_payload,
    resolve_max_tokens,
    sglang_request,
)

__all__ = [
    "CLAMP", "PLAIN_TEXT", "ChatFormatter", "ChatOutputParser", "ChatRequest", "CompletionFormatter",
    "CompletionRequest", "GenerateFormatter", "GenerateTokensRequest", "Output", "OutputRules", "PlainText",
    "ResponseMeta", "SGLangRequest", "SamplingRequest", "TokenNamer", "Usage", "chat_logprob_content", "generate_payload",
    "map_finish", "parse_chat_request", "parse_completion_request", "parse_generate_tokens", "parse_sampling",
    "resolve_max_tokens", "sglang_request", "top_row",
]
