"""Pick the tool-call parser a chat template implies, where its markers leave no doubt.

The template shows the model how calls are written (it renders earlier assistant calls
back), so its markers name the format. Order matters: Qwen3-Coder's template also has
`<tool_call>`, and DeepSeek V3.1's layout differs from V3's (no ```json fence), so it
gets no parser here. An explicit --tool-call-parser always wins over this guess.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# (parser, markers that must all appear, markers that must not appear)
_RULES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("qwen3_coder", ("<tool_call>", "<function=", "<parameter="), ()),
    ("hermes", ("<tool_call>", "</tool_call>"), ("<function=",)),
    ("mistral", ("[TOOL_CALLS]",), ()),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>", "```json"), ()),
    ("llama3_json", ("<|python_tag|>", '"parameters"'), ()),
)


def parser_for_template(template: str | None) -> str | None:
    """The --tool-call-parser name for this template, or None when no single rule matches."""
    if not template:
        return None
    matches = [
        name
        for name, required, excluded in _RULES
        if all(m in template for m in required) and not any(m in template for m in excluded)
    ]
    return matches[0] if len(matches) == 1 else None


def choose_tool_parser(explicit: str | None, template: str | None) -> str | None:
    """The flag if given, else the template's parser; logs where the choice came from."""
    if explicit:
        log.info("tool-call parser %s (from --tool-call-parser)", explicit)
        return explicit
    detected = parser_for_template(template)
    if detected:
        log.info("tool-call parser %s (detected from the chat template; --tool-call-parser overrides)", detected)
    else:
        log.info("no tool-call parser: none given and the chat template names none unambiguously")
    return detected
