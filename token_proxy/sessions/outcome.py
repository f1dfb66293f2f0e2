"""What a session lookup decided, in the two shapes a client reads: a header and a response field.

`X-Session-Continuity` (header) and `session_continuity` (top-level response field, next to
`prompt_token_ids`) carry the same facts:

- `hit`: the prompt is the stored prompt + completion ids followed by the ids of the new messages only;
- `hit; divergence=assistant_rerendered`: the same, but the chat template renders the previous
  assistant turn differently from the ids the model produced (e.g. it drops past reasoning or
  reformats tool calls); the model's ids were kept, so the prompt is NOT what a fresh render gives;
- `hit; divergence=history_rerendered`: the same, for unchanged earlier turns that the template
  renders differently now that the conversation grew (Qwen3 drops a tool cycle's reasoning once a
  new user query arrives);
- `fallback; reason=<reason>`: the proxy rendered the whole conversation (today's behaviour); the
  earlier turns' ids may differ from what the model produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

HEADER = "X-Session-Continuity"
RESPONSE_FIELD = "session_continuity"


class Fallback(str, Enum):
    """Why a session request was rendered in full."""

    UNKNOWN_SESSION = "unknown_session"  # never seen, evicted, expired, or seen by another worker
    TOOLS_CHANGED = "tools_changed"
    TEMPLATE_CHANGED = "template_changed"  # chat_template, chat_template_kwargs, documents, ...
    NOT_AN_EXTENSION = "not_an_extension"  # fewer messages, no assistant turn where the reply belongs
    HISTORY_EDITED = "history_edited"  # earlier messages render differently than last turn
    ASSISTANT_EDITED = "assistant_edited"  # the previous assistant message is not what the proxy returned
    NEW_ASSISTANT_MESSAGE = "new_assistant_message"  # an assistant turn the proxy did not generate
    TRUNCATED_TURN = "truncated_turn"  # a finish "length" turn the template renders differently
    TEMPLATE_MISMATCH = "template_mismatch"  # the model's ids cannot be located in the rendered text
    UNSUPPORTED_REQUEST = "unsupported_request"  # continue_final_message, no generation prompt, ...


class Divergence(str, Enum):
    ASSISTANT_RERENDERED = "assistant_rerendered"  # the previous assistant turn renders otherwise
    HISTORY_RERENDERED = "history_rerendered"  # unchanged earlier turns render otherwise


@dataclass(frozen=True, slots=True)
class SessionOutcome:
    status: str  # "hit" | "fallback"
    reason: Fallback | None = None
    divergence: Divergence | None = None
    reused_tokens: int = 0  # stored prompt + completion ids at the head of the new prompt
    new_tokens: int = 0  # ids tokenized for this request

    @classmethod
    def hit(cls, reused: int, new: int, divergence: Divergence | None = None) -> SessionOutcome:
        return cls("hit", None, divergence, reused, new)

    @classmethod
    def fallback(cls, reason: Fallback, new: int = 0) -> SessionOutcome:
        return cls("fallback", reason, None, 0, new)

    def header_value(self) -> str:
        if self.reason is not None:
            return f"fallback; reason={self.reason.value}"
        if self.divergence is not None:
            return f"hit; divergence={self.divergence.value}"
        return "hit"

    def as_field(self) -> dict:
        return {"status": self.status,
                "reason": self.reason.value if self.reason else None,
                "divergence": self.divergence.value if self.divergence else None,
                "reused_tokens": self.reused_tokens, "new_tokens": self.new_tokens}
