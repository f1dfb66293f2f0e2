"""Split one choice's completion into reasoning, content and tool calls, whole or as a stream.

`OutputParsing` is built once per request (see tools.request.output_parsing). `parse(text)`
handles a finished completion; `stream()` gives one `StreamParser` per choice, whose
`feed(delta_text)` / `finish()` return DeltaEvents. The stream replays the same pure
scans on the growing text, so its calls are those `parse` finds in the same text. With
tool_call_streaming "fragments" (formats with `progress`), a call's arguments go out as they
become fixed; a call that never completes then stays half sent, as in vLLM's stream.
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
    include_reasoning: bool = True  # the request's include_reasoning: false drops reasoning everywhere
    # vLLM also drops logprobs and token_ids (stream and whole) when the server has a parser and the
    # request says include_reasoning: false, so hidden reasoning cannot leak through them.
    hides_token_metadata: bool = False
    # --tool-call-streaming: "fragments" streams arguments as they are generated (formats with
    # `progress`: all of them); "whole" sends each call once complete, so a stream cut by
    # max_tokens never holds a half call.
    tool_call_streaming: str = "fragments"

    @property
    def streams_fragments(self) -> bool:
        return self.tool_call_streaming == "fragments" and hasattr(self.tool_format, "progress")

    def parse(self, text: str) -> ParsedOutput:
        """A non-streamed reply: the format's `whole` rule where it has one (vLLM's non-streaming parser)."""
        split = self.split(text, final=True)
        whole = getattr(self.tool_format, "whole", None)
        if whole is not None and split.rest is not None:
            scan = whole(split.rest, self.tools)
            scan = Scan(scan.content, scan.calls[:1]) if self.single_call else scan
        else:
            scan = self.scan(split.rest, final=True)
        return ParsedOutput(
            reasoning=self.shown_reasoning(split),
            content=self.content(split, scan),
            tool_calls=[self._with_id(call) for call in scan.calls],
        )

    def shown_reasoning(self, split: ReasoningSplit) -> str | None:
        return split.reasoning if self.reasoning and self.include_reasoning else None

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
    """One choice's incremental parser: vLLM's delta sequence; in "whole" mode nothing half-parsed leaked.

    Work per delta stays proportional to the delta, not to the text so far: only the text
    after what was already emitted (`_tail`) is rescanned. That is exact because no marker can
    start inside emitted text: a marker's possible beginning is always held back. Formats whose
    content is not a plain prefix (llama3_json, deepseek_v3) rescan the whole rest once a
    marker character shows up.
    """

    def __init__(self, parsing: OutputParsing):
        self._parsing = parsing
        self._chunks: list[str] = []  # the whole text, joined only when a full rescan needs it
        self._tail = ""  # the text after what was emitted (reasoning, then content)
        self._body_started = False  # whether it is known if the output opens with <think>
        self._in_rest = parsing.reasoning is None
        self._rest_start = 0  # where the text after reasoning begins
        self._content_sent = 0
        self._pure_content = True  # so far the rest is all emitted content (no call, nothing held)
        self.tool_calls: list[ToolCall] = []  # the calls streamed so far, with their ids (and arguments sent)
        self._fragments = parsing.streams_fragments
        self._progress_memo: dict = {}  # the format's per-call state between deltas (see `progress`)
        self.finished: ParsedOutput | None = None

    def feed(self, delta_text: str) -> list[DeltaEvent]:
        self._chunks.append(delta_text)
        self._tail += delta_text
        return self._advance(delta_text, final=False)

    def finish(self) -> list[DeltaEvent]:
        """Flush what was held back (partial markers; a last call closed only by the end)."""
        events = self._advance(None, final=True)
        parsing, text = self._parsing, "".join(self._chunks)
        split = parsing.split(text, final=True)
        self.finished = ParsedOutput(
            reasoning=parsing.shown_reasoning(split),
            content=parsing.content(split, parsing.scan(split.rest, final=True)),
            tool_calls=list(self.tool_calls),
        )
        return events

    def _advance(self, delta: str | None, final: bool) -> list[DeltaEvent]:
        events: list[DeltaEvent] = []
        if self._in_rest:
            self._advance_rest(delta, final, events)
        elif self._advance_reasoning(final, events):
            self._advance_rest(None, final, events)
        return events

    def _advance_reasoning(self, final: bool, events: list[DeltaEvent]) -> bool:
        """Emit new reasoning; True once reasoning ended (`_tail` is then the rest)."""
        think = self._parsing.reasoning
        if not self._body_started:
            if not final and len(self._tail) < len(think.start) and think.start.startswith(self._tail):
                return False  # maybe `<think>`, still arriving
            self._body_started = True
            self._tail = self._tail.removeprefix(think.start)
        if not final and not _has_any(self._tail, think.end_triggers):
            split = ReasoningSplit(self._tail, None)  # no end marker can start in it
        else:
            split = think.split_body(self._tail, final)
        if split.reasoning and self._parsing.include_reasoning:
            events.append(DeltaEvent("reasoning", split.reasoning))
        if split.rest is None:
            self._tail = self._tail[len(split.reasoning) :]
            return False
        self._in_rest = True
        self._rest_start = sum(map(len, self._chunks)) - len(split.rest)
        self._tail = split.rest
        return True

    def _advance_rest(self, delta: str | None, final: bool, events: list[DeltaEvent]) -> None:
        parsing = self._parsing
        fmt = parsing.tool_format
        if fmt is None or fmt.prefix_content or (
            not final and self._pure_content and delta and fmt.triggers and not _has_any(delta, fmt.triggers)
        ):  # the tail is all there is to scan
            plain = fmt is None or not fmt.prefix_content or (not final and not _has_any(self._tail, fmt.triggers))
            scan = Scan(content=self._tail) if plain else parsing.scan(self._tail, final)
            new_content, calls_text = scan.content, None
        else:
            rest = "".join(self._chunks)[self._rest_start :]
            scan = parsing.scan(rest, final)
            self._pure_content = not scan.calls and scan.content == rest
            new_content = scan.content[self._content_sent :]
            self._tail = rest[self._content_sent :]
            calls_text = rest  # content may come after the calls too (deepseek_v3): `progress` reads all of it
        if new_content:
            events.append(DeltaEvent("content", new_content))
            self._content_sent += len(new_content)
            self._tail = self._tail[len(new_content) :]
        if self._fragments:
            if scan.calls or not fmt.triggers or _has_any(self._tail, fmt.triggers):
                self._stream_fragments(self._tail if calls_text is None else calls_text, final, events)
            return
        for index in range(len(self.tool_calls), len(scan.calls)):
            call = scan.calls[index]
            tool_call = ToolCall(fmt.new_id(), call.name, call.arguments)
            self.tool_calls.append(tool_call)
            events.append(DeltaEvent("tool_call", index=index, id=tool_call.id, name=call.name))
            events.append(DeltaEvent("arguments", text=call.arguments, index=index))

    def _stream_fragments(self, text: str, final: bool, events: list[DeltaEvent]) -> None:
        """vLLM's argument deltas: a call's first delta names it, later ones add what became fixed.

        `text` holds the calls (from the first call marker, or the whole rest). What was sent is
        never taken back: a call cut by max_tokens stays half sent (finish_reason "length"), as in
        vLLM's stream.
        """
        parsing = self._parsing
        fmt = parsing.tool_format
        progress = fmt.progress(text, final, parsing.tools, self._progress_memo)
        for index, call in enumerate(progress[:1] if parsing.single_call else progress):
            if index == len(self.tool_calls):
                # vLLM's forced calls (serving layer) send the arguments so far with the name; a parser's not.
                first = call.arguments if getattr(fmt, "header_carries_arguments", False) else None
                self.tool_calls.append(ToolCall(fmt.new_id(), call.name, first or ""))
                events.append(DeltaEvent("tool_call", index=index, id=self.tool_calls[index].id, name=call.name,
                                         arguments=first))
            sent = self.tool_calls[index]
            # A prefix only: an object repeating a key re-orders the final arguments (json.loads keeps
            # the last value at the first place), and what was sent cannot be taken back.
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
                events.append(DeltaEvent("arguments", text=call.arguments[len(sent.arguments):], index=index))
                self.tool_calls[index] = ToolCall(sent.id, sent.name, call.arguments)


def _has_any(text: str, chars: str) -> bool:
    return any(char in text for char in chars)
