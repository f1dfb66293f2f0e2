"""What parsing a completion yields, in vLLM 0.33's shapes.

A ToolCall serialises to vLLM's `message.tool_calls[i]`; a DeltaEvent is one piece of a
streamed delta, and `merge_deltas` folds one chunk's events into vLLM's `delta` object.
"""

from __future__ import annotations

import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

IdFactory = Callable[[], str]


def vllm_call_id() -> str:
    """vLLM 0.33's make_tool_call_id(): "chatcmpl-tool-" + random_uuid() (16 hex digits)."""
    return f"chatcmpl-tool-{uuid.uuid4().int & ((1 << 64) - 1):016x}"


def mistral_call_id() -> str:
    """MistralToolCall.generate_random_id(): 9 alphanumerics (mistral-common validates this)."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """A parsed call before it gets an id: the function name and its arguments as a JSON string."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """One choice's text split as vLLM's parser splits it."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def message_fields(self) -> dict:
        """The keys this parse sets on vLLM's `message` (`tool_calls` only when there are any)."""
        fields = {"content": self.content, "reasoning": self.reasoning}
        if self.tool_calls:
            fields["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return fields


@dataclass(frozen=True, slots=True)
class DeltaEvent:
    """One piece of a streamed delta.

    kind is "reasoning" or "content" (text set), "tool_call" (a call starts: index, id, name, and
    for a forced call the first arguments, as vLLM's serving layer sends them with the name)
    or "arguments" (index, text = an arguments fragment).
    """

    kind: str
    text: str = ""
    index: int = 0
    id: str | None = None
    name: str | None = None
    arguments: str | None = None  # "tool_call" only: None leaves `function.arguments` out

    def tool_call_delta(self) -> dict:
        if self.kind == "tool_call":  # DeltaToolCall's field order: id, type, index, function
            function = {"name": self.name}
            if self.arguments is not None:
                function["arguments"] = self.arguments
            return {"id": self.id, "type": "function", "index": self.index, "function": function}
        return {"index": self.index, "function": {"arguments": self.text}}


def merge_deltas(events: list[DeltaEvent]) -> dict:
    """One chunk's events as vLLM's `delta` (keys present only when set, as exclude_unset leaves them)."""
    delta: dict = {}
    for event in events:
        if event.kind in ("reasoning", "content"):
            delta[event.kind] = delta.get(event.kind, "") + event.text
        else:
            delta.setdefault("tool_calls", []).append(event.tool_call_delta())
    return delta
