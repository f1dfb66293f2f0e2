"""Tool calls and reasoning on the chat path, parsed as vLLM 0.33 parses them.

Per request: `validate_tools(...)` (400s), `constraint_for(...)` (sampling_params to force a
call), `output_parsing(...)` → OutputParsing; per choice: `parsing.parse(text)` or
`parsing.stream()` → StreamParser.feed/finish; then `finish_reason(...)`.
"""

from token_proxy.tools.calls import DeltaEvent, FunctionCall, ParsedOutput, ToolCall, merge_deltas
from token_proxy.tools.formats import TOOL_PARSERS
from token_proxy.tools.history import messages_for_template
from token_proxy.tools.output_parser import OutputParsing, StreamParser
from token_proxy.tools.reasoning import REASONING_PARSERS
from token_proxy.tools.request import (
    check_flags,
    constraint_for,
    effective_tool_choice,
    finish_reason,
    output_parsing,
    sampling_overrides,
    tools_for_template,
    validate_tools,
)
from token_proxy.tools.template_detect import choose_tool_parser, parser_for_template

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "DeltaEvent",
    "FunctionCall",
    "OutputParsing",
    "ParsedOutput",
    "StreamParser",
    "ToolCall",
    "check_flags",
    "choose_tool_parser",
    "constraint_for",
    "effective_tool_choice",
    "finish_reason",
    "merge_deltas",
    "messages_for_template",
    "output_parsing",
    "parser_for_template",
    "sampling_overrides",
    "tools_for_template",
    "validate_tools",
]
