"""Outputs -> vLLM's chat completion body, or its chat.completion.chunk sequence (pure).

Every key vLLM 0.33 emits is present, in its order, null when not requested. Stream key
presence follows vLLM's `model_dump_json(exclude_unset=True)`: the role chunk carries
`prompt_token_ids` (null unless asked) and `prompt_text`; content chunks carry `token_ids` and
`kv_transfer_params`; the finish chunk adds `stop_reason` and `weight_versions`; the usage
chunk drops every null.

The assistant text passes through a `ChatOutputParser` (the hook for tool calls and reasoning).
"""

from __future__ import annotations

from typing import Protocol

from token_proxy.api.chat.request import ChatRequest
from token_proxy.api.logprobs import TokenNamer, chat_logprob_content, prompt_logprobs
from token_proxy.tools import OutputParsing, StreamParser, merge_deltas
from token_proxy.tools import finish_reason as tool_finish_reason
from token_proxy.vocabulary import Output, ResponseMeta, Usage


class ChatOutputParser(Protocol):
    """Splits generated text into the assistant message's fields (content, reasoning, tool_calls).

    The output-parser hook: a tool-call / reasoning parser (pure functions over text) plugs in
    here, for both modes. `message` gets a choice's whole text; `delta` gets a stream's new
    text for choice `index` (`finished` on its last delta) and returns the delta's fields
    ({} when it holds everything back). `finish_reason` maps the engine's finish reason, knowing
    whether the choice carried tool calls. `hides_token_metadata`: drop logprobs and token_ids
    (vLLM does with include_reasoning false, so hidden reasoning cannot leak through them).
    """

    hides_token_metadata: bool

    def message(self, text: str) -> dict: ...

    def delta(self, index: int, text: str, finished: bool) -> dict: ...

    def finish_reason(self, reason: str | None, tool_calls: bool) -> str | None: ...


class PlainText:
    """No parsing: all text is content (no work per chunk)."""

    hides_token_metadata = False

    def message(self, text: str) -> dict:
        return {"content": text}

    def delta(self, index: int, text: str, finished: bool) -> dict:
        return {"content": text}

    def finish_reason(self, reason: str | None, tool_calls: bool) -> str | None:
        return "tool_calls" if tool_calls and reason == "stop" else reason


PLAIN_TEXT = PlainText()


class ToolsAndReasoning:
    """tools.OutputParsing behind the hook: vLLM 0.33's tool-call / reasoning split, one StreamParser
    per streamed choice. Streamed calls equal parsed calls by construction (the stream replays the parse);
    with --tool-call-streaming fragments, a call that never completes (cut by max_tokens) stays as far
    as it was sent, and makes finish_reason "tool_calls" on a natural stop, as vLLM's `tools_streamed`."""

    def __init__(self, parsing: OutputParsing, tool_choice: object):
        self._parsing = parsing
        self._tool_choice = tool_choice
        self._streams: dict[int, StreamParser] = {}
        self.hides_token_metadata = parsing.hides_token_metadata

    def message(self, text: str) -> dict:
        return self._parsing.parse(text).message_fields()

    def delta(self, index: int, text: str, finished: bool) -> dict:
        parser = self._streams.get(index)
        if parser is None:
            parser = self._streams[index] = self._parsing.stream()
        events = parser.feed(text) if text else []
        if finished:
            events += parser.finish()
        return merge_deltas(events)

    def finish_reason(self, reason: str | None, tool_calls: bool) -> str | None:
        return None if reason is None else tool_finish_reason(reason, self._tool_choice, tool_calls)


def assistant_message(fields: dict) -> dict:
    # vLLM drops `tool_calls` when empty; content is "" (not null) for empty output.
    message = {"role": "assistant", "content": fields.get("content", ""), "refusal": None, "annotations": None,
               "audio": None, "function_call": None, "reasoning": fields.get("reasoning")}
    if fields.get("tool_calls"):
        message["tool_calls"] = fields["tool_calls"]
    return message


class ChatFormatter:
    def __init__(self, req: ChatRequest, meta: ResponseMeta, namer: TokenNamer | None,
                 parser: ChatOutputParser = PLAIN_TEXT, session: dict | None = None):
        self._req = req
        self._session = session  # `session_continuity`, on session requests only
        self._meta = meta
        self._namer = namer  # None when the request asks for no logprobs (never read then)
        self._parser = parser
        self._prompt_ids = meta.prompt_ids[0]
        self._tool_choices: set[int] = set()  # streamed choices that sent a tool call
        self._returns_prompt_ids = req.output.return_token_ids and not parser.hides_token_metadata
        # A streamed delta that a parser holds back entirely is not sent (as vLLM), unless the chunk
        # carries token ids or logprobs, which must all reach the client.
        self._skips_empty = not (self._returns_prompt_ids or req.sampling.logprobs)
        # vLLM honours continuous_usage_stats only together with include_usage.
        self._continuous_usage = req.output.include_usage and req.output.continuous_usage_stats
        # A running chunk: id, model, the content delta and token ids (see Formatter.plain_chunks).
        self.plain_chunks = type(parser) is PlainText and not req.sampling.logprobs and not self._continuous_usage

    # Not streaming

    def response(self, outputs: list[Output], usage: Usage) -> dict:
        meta = self._meta
        first = outputs[0] if outputs else None
        body = {
            "id": meta.response_id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [self._choice(out) for out in outputs],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage.body(),
            "prompt_logprobs": self._prompt_logprobs(first),
            "prompt_token_ids": self._prompt_ids if self._returns_prompt_ids else None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        if self._session is not None:
            body["session_continuity"] = self._session
        return body

    def _choice(self, out: Output) -> dict:
        fields = self._parser.message(out.text)
        return {
            "index": out.index,
            "message": assistant_message(fields),
            "logprobs": self._logprobs(out),
            "finish_reason": self._parser.finish_reason(out.finish_reason, bool(fields.get("tool_calls"))),
            "stop_reason": out.stop_reason,
            "token_ids": self._token_ids(out),
            "routed_experts": None,
            "weight_versions": out.weight_versions,
        }

    def _token_ids(self, out: Output) -> list[int] | None:
        return out.token_ids if self._returns_prompt_ids else None  # the same switch as the prompt's ids

    def _logprobs(self, out: Output) -> dict | None:
        if not self._req.sampling.logprobs or self._parser.hides_token_metadata:
            return None
        return {"content": chat_logprob_content(out.logprobs, out.top_logprobs, self._req.sampling.top_logprobs,
                                                self._namer)}

    def _prompt_logprobs(self, out: Output | None) -> list | None:
        top_n = self._req.sampling.prompt_logprobs
        if top_n is None or out is None:
            return None
        return prompt_logprobs(out.meta.get("input_token_logprobs") or [], out.meta.get("input_top_logprobs"),
                               top_n, self._namer)

    # Streaming

    def start(self) -> list[dict]:
        """One role chunk per choice, each carrying the prompt ids (null unless asked)."""
        chunks = []
        for index in range(self._req.sampling.n):
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            chunk = self._chunk(choice, completion_tokens=0)
            chunk["prompt_token_ids"] = self._prompt_ids if self._returns_prompt_ids else None
            chunk["prompt_text"] = None
            if self._session is not None:
                chunk["session_continuity"] = self._session
            chunks.append(chunk)
        return chunks

    def chunk(self, out: Output) -> dict | None:
        """One choice's chunk; None for a held-back delta with nothing else to carry (not sent)."""
        finished = out.finish_reason is not None
        delta = self._parser.delta(out.index, out.text, finished)
        if "tool_calls" in delta:
            self._tool_choices.add(out.index)
        if not finished and not delta and self._skips_empty:
            return None
        choice = {"index": out.index, "delta": delta, "logprobs": self._logprobs(out), "finish_reason": None}
        if not finished:
            choice["token_ids"] = self._token_ids(out)
            return self._chunk(choice, out.completion_tokens, kv_transfer_params=None)
        if out.completion_tokens == 0 and delta == {"content": ""}:
            choice["delta"] = {}
        choice["finish_reason"] = self._parser.finish_reason(out.finish_reason, out.index in self._tool_choices)
        choice["stop_reason"] = out.stop_reason
        choice["token_ids"] = self._token_ids(out)
        choice["weight_versions"] = out.weight_versions
        chunk = self._chunk(choice, out.completion_tokens)
        if not self._req.output.include_usage:
            chunk["system_fingerprint"] = None  # vLLM puts it on the last message only
        chunk["kv_transfer_params"] = None
        return chunk

    def finish(self, usage: Usage) -> list[dict]:
        """The usage chunk, when asked for (None fields dropped, as vLLM does); [DONE] is the writer's."""
        if not self._req.output.include_usage:
            return []
        meta = self._meta
        return [{"id": meta.response_id, "object": "chat.completion.chunk", "created": meta.created,
                 "model": meta.model, "choices": [], "usage": usage.body(drop_nulls=True)}]

    def _chunk(self, choice: dict, completion_tokens: int, **extra) -> dict:
        meta = self._meta
        chunk = {"id": meta.response_id, "object": "chat.completion.chunk", "created": meta.created,
                 "model": meta.model, "choices": [choice]}
        if self._continuous_usage:
            prompt = len(self._prompt_ids)
            chunk["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt + completion_tokens,
                              "completion_tokens": completion_tokens, "completion_tokens_details": None}
        chunk.update(extra)
        return chunk
