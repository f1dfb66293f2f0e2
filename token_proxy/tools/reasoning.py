"""Think-tag reasoning parsers by vLLM 0.33's `--reasoning-parser` names.

vLLM's rule (BaseThinkingReasoningParser / the qwen3 engine): a leading `<think>` is dropped;
everything before `</think>` is reasoning and the rest is content (null when empty); with no
`</think>` at all the whole output is reasoning. qwen3 also ends reasoning at `<tool_call>`
(kept for the tool parser) and, like deepseek_v3, follows the template's thinking switch.
`split` is replayable like a tool format: with final=False a partial end marker is held back.
"""

from __future__ import annotations

from dataclasses import dataclass

from token_proxy.tools.formats.scan import held_back


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    reasoning: str
    rest: str | None  # the text after reasoning ended; None while reasoning goes on


@dataclass(frozen=True)
class ThinkFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    implicit_ends: tuple[str, ...] = ()  # markers that end reasoning and stay in the content
    thinking_kwargs: tuple[str, ...] = ()  # chat_template_kwargs that switch thinking on/off
    thinking_default: bool = True

    def thinking(self, chat_template_kwargs: dict | None) -> bool:
        """Whether this request thinks at all (vLLM's qwen3: enable_thinking, default on)."""
        kwargs = chat_template_kwargs or {}
        values = [kwargs[key] for key in self.thinking_kwargs if kwargs.get(key) is not None]
        return any(bool(v) for v in values) if values else self.thinking_default

    def split(self, text: str, final: bool) -> ReasoningSplit:
        if not final and len(text) < len(self.start) and self.start.startswith(text):
            return ReasoningSplit("", None)  # maybe `<think>`, still arriving
        return self.split_body(text.removeprefix(self.start), final)

    def split_body(self, body: str, final: bool) -> ReasoningSplit:
        """`split` after the leading `<think>` (streams resume here, after what they sent)."""
        ends = [(i, marker) for marker in (self.end, *self.implicit_ends) if (i := body.find(marker)) >= 0]
        if ends:
            at, marker = min(ends)
            skip = len(marker) if marker == self.end else 0
            return ReasoningSplit(body[:at], body[at + skip :])
        if final:
            return ReasoningSplit(body, None)
        return ReasoningSplit(body[: len(body) - held_back(body, (self.end, *self.implicit_ends))], None)


    @property
    def end_triggers(self) -> str:
        """First characters of the markers that end reasoning: text without them cannot end it."""
        return "".join({marker[0] for marker in (self.end, *self.implicit_ends)})


REASONING_PARSERS: dict[str, ThinkFormat] = {
    "deepseek_r1": ThinkFormat("deepseek_r1"),
    "qwen3": ThinkFormat("qwen3", implicit_ends=("<tool_call>",), thinking_kwargs=("enable_thinking",)),
    "deepseek_v3": ThinkFormat(
        "deepseek_v3", thinking_kwargs=("thinking", "enable_thinking"), thinking_default=False
    ),
    "step3": ThinkFormat("step3"),
    "minimax_m2": ThinkFormat("minimax_m2"),
}
