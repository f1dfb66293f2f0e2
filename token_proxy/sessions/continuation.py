"""The continuation rule: extend the stored ids by the new messages only, or say why not.

Turn k-1 stored: the messages it rendered (n of them), the prompt ids it sent, the completion ids the
model produced and the assistant message the proxy returned. Turn k sends messages M. With `full` the
template's rendering of M (with the generation prompt):

1. same tools and template settings as turn k-1;
2. M = M[:n] + [assistant] + new, with no assistant among `new` (those were not generated here);
3. M[:n] renders as it did at turn k-1 (the stored text's digest): the earlier history is unchanged
   *as the template renders it*. If it renders differently but the messages are the same (normalized),
   the template rewrote earlier turns itself: the model's ids are kept, the new messages' text comes
   from a short probe conversation, and `history_rerendered` is reported; otherwise `history_edited`;
4. M[n] equals the returned assistant message, normalized (messages.py), or renders identically;
5. the model's ids are located in `full`: right after turn k-1's generation prompt when the template
   renders the completion verbatim (then the prompt equals a fresh render up to BPE merges), else
   just after the completion's stop token (e.g. `<|im_end|>`) when the template rewrites that turn
   (drops its reasoning, reformats tool calls): the model's ids are kept and the divergence reported.
   A finish "length" turn has no stop token; when rendered verbatim the template's own close follows
   it (as renderers' `trim_to_turn_close(synthesize_close=...)` does), otherwise it falls back;
6. the prompt is stored prompt ids + completion ids + encode(text after the cut) — only the new text is
   tokenized. The split sits after a special token in ChatML-like templates, so the suffix tokenizes
   as it would inside the full text.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import takewhile

from token_proxy.errors import InvalidRequest
from token_proxy.sessions.codec import ChatCodec, digest_json, digest_text
from token_proxy.sessions.messages import normalized, same_message
from token_proxy.sessions.outcome import Divergence, Fallback


@dataclass(frozen=True, slots=True)
class Rendering:
    """What turn k-1's rendering of its n messages looked like (the reference for turn k)."""

    tools_key: bytes
    template_key: bytes
    n_messages: int
    base_len: int  # len(render(messages, add_generation_prompt=False))
    base_digest: bytes
    gen_prompt: str | None  # full[base_len:], None when `full` does not extend `base`
    messages_digest: bytes  # of the messages as normalized (tells client edits from template rewrites)


@dataclass(frozen=True, slots=True)
class Turn:
    """One stored turn of a session: what was sent, what came back."""

    rendering: Rendering
    prompt_ids: array
    completion_ids: array
    completion_len: int  # of the completion decoded with special tokens
    completion_digest: bytes
    stop_text: str | None  # the text of the completion's final special token, if any
    finish_reason: str
    reply: dict  # the assistant message the proxy returned, as returned
    nbytes: int


def rendering_of(messages: list[dict], full: str, codec: ChatCodec, gen_prompt: str) -> Rendering:
    """The reference for the next turn; `gen_prompt` is the template's usual generation prompt.

    When `full` ends with it, the rendering without it is `full` minus it (one render per turn);
    otherwise the template is asked.
    """
    if gen_prompt and full.endswith(gen_prompt):
        base = full[:len(full) - len(gen_prompt)]
    else:
        base = _render_or_none(codec, messages, False) or full
        gen_prompt = full[len(base):] if full.startswith(base) and base != full else None
    return Rendering(codec.tools_key, codec.template_key, len(messages), len(base), digest_text(base), gen_prompt,
                     messages_digest(messages))


def messages_digest(messages: list[dict]) -> bytes:
    return digest_json([normalized(m) for m in messages])


def generation_prompt(codec: ChatCodec) -> str:
    """What the template appends for a new assistant turn, found on a one-message probe."""
    probe = [{"role": "user", "content": "?"}]
    with_prompt, without = _render_or_none(codec, probe), _render_or_none(codec, probe, False)
    if with_prompt is None or without is None or not with_prompt.startswith(without):
        return ""
    return with_prompt[len(without):]


def _render_or_none(codec: ChatCodec, messages: list[dict], add_generation_prompt: bool = True) -> str | None:
    """A render the session logic asks for itself: a template that refuses it means "no match", not a 400."""
    try:
        return codec.render(messages, add_generation_prompt)
    except InvalidRequest:
        return None


def continue_turn(turn: Turn, messages: list[dict], full: str,
                  codec: ChatCodec) -> tuple[str, Divergence | None] | Fallback:
    """The text to tokenize after the stored ids (and whether the template diverged), or why not."""
    ref = turn.rendering
    if ref.tools_key != codec.tools_key:
        return Fallback.TOOLS_CHANGED
    if ref.template_key != codec.template_key:
        return Fallback.TEMPLATE_CHANGED
    n = ref.n_messages
    if len(messages) < n + 2 or messages[n].get("role") != "assistant":
        return Fallback.NOT_AN_EXTENSION
    new = messages[n + 1:]
    if any(m.get("role") == "assistant" for m in new):
        return Fallback.NEW_ASSISTANT_MESSAGE
    history_renders_the_same = digest_text(full[:ref.base_len]) == ref.base_digest
    if not history_renders_the_same and messages_digest(messages[:n]) != ref.messages_digest:
        return Fallback.HISTORY_EDITED
    if not same_message(messages[n], turn.reply) and _render_or_none(codec, [*messages[:n], turn.reply, *new]) != full:
        return Fallback.ASSISTANT_EDITED
    if not history_renders_the_same:
        return _suffix_on_probe(turn, messages, new, codec)
    return _suffix_in_full(turn, full)


def _suffix_in_full(turn: Turn, full: str) -> tuple[str, Divergence | None] | Fallback:
    start = turn.rendering.base_len
    gen_prompt = turn.rendering.gen_prompt
    if gen_prompt is not None and full.startswith(gen_prompt, start):
        body = start + len(gen_prompt)
        end = body + turn.completion_len
        if digest_text(full[body:end]) == turn.completion_digest:
            return full[end:], None
    if turn.stop_text:
        at = full.find(turn.stop_text, start)
        if at >= 0:
            return full[at + len(turn.stop_text):], Divergence.ASSISTANT_RERENDERED
    return Fallback.TRUNCATED_TURN if turn.finish_reason == "length" else Fallback.TEMPLATE_MISMATCH


def _suffix_on_probe(turn: Turn, messages: list[dict], new: list[dict],
                     codec: ChatCodec) -> tuple[str, Divergence | None] | Fallback:
    """The template rewrote unchanged earlier turns (e.g. Qwen3 drops a tool cycle's reasoning once a new
    user query arrives), so `full` no longer contains the stored text. The new messages' text is taken
    from a short probe conversation instead: the system messages, a plain user/assistant pair, `new`."""
    if not turn.stop_text:
        return Fallback.TRUNCATED_TURN if turn.finish_reason == "length" else Fallback.TEMPLATE_MISMATCH
    lead = takewhile(lambda m: m.get("role") in ("system", "developer"), messages)
    opening = [*lead, {"role": "user", "content": "?"}]
    text = _render_or_none(codec, [*opening, {"role": "assistant", "content": "?"}, *new])
    start = _render_or_none(codec, opening)
    at = -1 if text is None or start is None else text.find(turn.stop_text, len(start))
    if at < 0:
        return Fallback.TEMPLATE_MISMATCH
    return text[at + len(turn.stop_text):], Divergence.HISTORY_RERENDERED
