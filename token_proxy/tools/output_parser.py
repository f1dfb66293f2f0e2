"""Split one choice's completion into reasoning, content and tool calls, whole or as a stream.

`OutputParsing` is built once per request (see tools.request.output_parsing). `parse(text)`
handles a finished completion; `stream()` gives one `StreamParser` per choice, whose
`feed(delta_text)` / `finish()` return DeltaEvents. The stream replays the same pure
scans on the growing text, so its calls are those `parse` finds in the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

from token_proxy.tools.calls import DeltaEvent, FunctionCall, ParsedOutput, ToolCall
from token_proxy.tools.formats.scan import Scan, ToolFormat
from token_proxy.tools.reasoning import ReasoningSplit, ThinkFormat


@dataclass(frozen=True)
class OutputParsing:
    tool_format: ToolFormat | None = None  # None: tool calls are not parsed (no tools, "none", no parser)
    reasoning: ThinkFormat | None = None  # None: no reasoning parser, or this request does not think
    tools: list | None = None  # the request's tools (qwen3_coder converts values by their schema)
    forced: bool = False  # "required" or a named function: content is at least ""
    single_call: bool = False  # parallel_tool_calls: false keeps the first call only

    def parse(self, text: str) -> ParsedOutput:
        split = self.split(text, final=True)
        scan = self.scan(split.rest, final=True)
        return ParsedOutput(
            reasoning=split.reasoning if self.reasoning else None,
            content=self.content(split, scan),
            tool_calls=[self._with_id(call) for call in scan.calls],
        )

    def stream(self) -> StreamParser:
        return StreamParser(self)

    def split(self, text: str, final: bool) -> ReasoningSplit:
        return self.reasoning.split(text, final) if self.reasoning else ReasoningSplit("", text)

    def scan(self, rest: str | None, final: bool) -> Scan:
        if rest is None:
            return Scan()
        if self.tool_format is None:
            return Scan(content=rest)
        scan = self.tool_format.scan(rest, final, self.tools)
        return Scan(scan.content, scan.calls[:1]) if self.single_call else scan

    def content(self, split: ReasoningSplit, scan: Scan) -> str | None:
        """vLLM's message.content for the final text."""
        content: str | None = scan.content
        if split.rest is None or (self.reasoning and not split.rest):
            content = None  # all reasoning, or nothing after `</think>`
        elif scan.calls and not content.strip():
            content = None  # whitespace beside tool calls is dropped
        elif not content and split.rest:
            content = None  # all of it was (incomplete) call markup
        if self.forced:
            return content or ""
        return content

    def _with_id(self, call: FunctionCall) -> ToolCall:
        return ToolCall(self.tool_format.new_id(), call.name, call.arguments)


class StreamParser:
    """One choice's incremental parser: vLLM's delta sequence, nothing half-parsed leaked."""

    def __init__(self, parsing: OutputParsing):
        self._parsing = parsing
        self._text = ""
        self._reasoning_sent = 0
        self._content_sent = 0
        self._rest_start: int | None = None if parsing.reasoning else 0
        self._pure_reasoning = self._pure_content = True
        self.tool_calls: list[ToolCall] = []  # the calls streamed so far, with their ids
        self.finished: ParsedOutput | None = None

    def feed(self, delta_text: str) -> list[DeltaEvent]:
        self._text += delta_text
        return self._advance(delta_text, final=False)

    def finish(self) -> list[DeltaEvent]:
        """Flush what was held back (partial markers; a last call closed only by the end)."""
        events = self._advance(None, final=True)
        parsing = self._parsing
        split = parsing.split(self._text, final=True)
        self.finished = ParsedOutput(
            reasoning=split.reasoning if parsing.reasoning else None,
            content=parsing.content(split, parsing.scan(split.rest, final=True)),
            tool_calls=list(self.tool_calls),
        )
        return events

    def _advance(self, delta: str | None, final: bool) -> list[DeltaEvent]:
        events: list[DeltaEvent] = []
        rest_seen = self._rest_start is not None  # scanned before: the shortcut may apply to this delta
        if not rest_seen:
            self._advance_reasoning(delta, final, events)
        if self._rest_start is not None:
            self._advance_rest(delta if rest_seen else None, final, events)
        return events

    def _advance_reasoning(self, delta: str | None, final: bool, events: list[DeltaEvent]) -> None:
        think = self._parsing.reasoning
        if not final and self._pure_reasoning and delta is not None and not _has_any(delta, think.triggers):
            reasoning = self._text[len(think.start):] if self._text.startswith(think.start) else self._text
            rest = None
        else:
            split = think.split(self._text, final)
            reasoning, rest = split.reasoning, split.rest
        body_len = len(self._text) - (len(think.start) if self._text.startswith(think.start) else 0)
        self._pure_reasoning = rest is None and len(reasoning) == body_len
        self._emit_text("reasoning", reasoning, events)
        if rest is not None:
            self._rest_start = len(self._text) - len(rest)

    def _advance_rest(self, delta: str | None, final: bool, events: list[DeltaEvent]) -> None:
        parsing, rest = self._parsing, self._text[self._rest_start:]
        fmt = parsing.tool_format
        shortcut = fmt is None or (
            not final and self._pure_content and delta is not None and fmt.triggers
            and not _has_any(delta, fmt.triggers)
        )
        scan = Scan(content=rest) if shortcut else parsing.scan(rest, final)
        self._pure_content = not scan.calls and scan.content == rest
        self._emit_text("content", scan.content, events)
        for index in range(len(self.tool_calls), len(scan.calls)):
            call = scan.calls[index]
            tool_call = ToolCall(fmt.new_id(), call.name, call.arguments)
            self.tool_calls.append(tool_call)
            events.append(DeltaEvent("tool_call", index=index, id=tool_call.id, name=call.name))
            events.append(DeltaEvent("arguments", text=call.arguments, index=index))

    def _emit_text(self, kind: str, text: str, events: list[DeltaEvent]) -> None:
        sent = self._reasoning_sent if kind == "reasoning" else self._content_sent
        if len(text) > sent:
            events.append(DeltaEvent(kind, text[sent:]))
            if kind == "reasoning":
                self._reasoning_sent = len(text)
            else:
                self._content_sent = len(text)


def _has_any(text: str, chars: str) -> bool:
    return any(char in text for char in chars)
