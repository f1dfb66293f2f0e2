"""POST /v1/chat/completions: the request body, validated into plain dataclasses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from token_proxy.api.fields import (
    OutputOptions,
    bad,
    opt_bool,
    opt_int,
    opt_request_id,
    opt_str,
    parse_output_options,
)
from token_proxy.api.messages import parse_chat_prompt
from token_proxy.api.sampling import parse_sampling
from token_proxy.sessions.keys import SESSION_ID_FIELD, SESSION_ID_HEADER, session_key
from token_proxy.tokenization.renderer import ChatPrompt
from token_proxy.tools import (
    OutputParsing,
    constraint_for,
    output_parsing,
    sampling_overrides,
    tools_for_template,
    validate_tools,
)
from token_proxy.vocabulary import SamplingRequest


@dataclass(frozen=True, slots=True)
class ToolFlags:
    """The server's tool and reasoning flags a chat request is checked against and parsed by (vLLM's)."""

    tool_call_parser: str | None = None  # the chosen parser (flag or chat template)
    enable_auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None
    tool_call_streaming: str = "fragments"


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str | None
    prompt: ChatPrompt
    sampling: SamplingRequest
    output: OutputOptions
    # Non-OpenAI extensions, as vLLM has them:
    request_id: str | None = None  # becomes the SGLang rid
    cache_salt: str | None = None  # isolates prefix-cache state
    priority: int | None = None
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    prompt_ids: tuple[int, ...] | None = None  # /v1/chat/completions/tokens: ids given, not rendered
    # Tools as the client sent them (prompt.tools is what the template renders), and how to use them:
    tools: list | None = None
    tool_choice: object = None  # raw: None when absent ("auto" with tools, else "none", as vLLM)
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True


def parse_chat_request(body: object, vocab_size: int, tool_flags: ToolFlags = ToolFlags()) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    sampling = parse_sampling(body, vocab_size)
    output = parse_output_options(body)
    if output.stream and sampling.prompt_logprobs is not None:
        raise bad("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.")
    uses_tools = _uses_tools(body)
    prompt = parse_chat_prompt(body, uses_tools)
    tools, tool_choice = body.get("tools"), body.get("tool_choice")
    if uses_tools:
        validate_tools(tools, tool_choice, tool_parser=tool_flags.tool_call_parser,
                       auto_tool_choice=tool_flags.enable_auto_tool_choice)
        rendered_tools = tools_for_template(prompt.tools, tool_choice,
                                            tool_flags.exclude_tools_when_tool_choice_none)
        if rendered_tools is not prompt.tools:
            prompt = dataclasses.replace(prompt, tools=rendered_tools)
    return ChatRequest(
        model=opt_str(body, "model"),
        prompt=prompt,
        sampling=sampling,
        output=output,
        request_id=opt_request_id(body),
        cache_salt=opt_str(body, "cache_salt"),
        priority=opt_int(body, "priority"),
        truncate_prompt_tokens=opt_int(body, "truncate_prompt_tokens", lo=1),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=opt_bool(body, "parallel_tool_calls"),
        include_reasoning=opt_bool(body, "include_reasoning", True),
    )


def _uses_tools(body: dict) -> bool:
    """Whether tools/ has anything to do with this body: `tools`, a `tool_choice` other than "none", or
    tool calls / tool results in the history. Without them validate_tools, tools_for_template,
    messages_for_template and output_parsing are no-ops, so a plain chat skips tools/ (issue 21)."""
    if body.get("tools") is not None or body.get("tool_choice") not in (None, "none"):
        return True
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("tool_calls") is not None or m.get("role") == "tool") for m in messages)


@dataclass(frozen=True, slots=True)
class ChatFeatures:
    """What a chat request uses beyond plain text: tools/ (how its output is parsed, the sampling_params a
    forced call or tool markers need) and a session. `for_request` is None for a plain chat."""

    parsing: OutputParsing
    sampling_overrides: dict
    session_key: str | None = None  # X-Session-ID / session_id, checked (a bad key is a 400)

    @classmethod
    def for_request(cls, req: ChatRequest, body: dict, headers, flags: ToolFlags) -> ChatFeatures | None:
        """None (nothing to do) without tools, tool_choice, tool messages, a reasoning parser or a session
        id; otherwise what vLLM 0.33's rules make of them. `headers` is None where a route has no sessions."""
        key = None
        if headers is not None and (SESSION_ID_HEADER in headers or body.get(SESSION_ID_FIELD) is not None):
            key = session_key(headers, body)
        # include_reasoning: false with a tool parser on hides token metadata even without tools.
        hides = not req.include_reasoning and flags.tool_call_parser and flags.enable_auto_tool_choice
        if key is None and not flags.reasoning_parser and not hides and not _uses_tools(body):
            return None
        parsing = output_parsing(req.tools, req.tool_choice, tool_parser=flags.tool_call_parser,
                                 auto_tool_choice=flags.enable_auto_tool_choice,
                                 reasoning_parser=flags.reasoning_parser,
                                 chat_template_kwargs=req.prompt.chat_template_kwargs,
                                 parallel_tool_calls=req.parallel_tool_calls,
                                 include_reasoning=req.include_reasoning,
                                 tool_call_streaming=flags.tool_call_streaming)
        # A forced call ("required", a named function) is a json_schema constraint; tool markers that
        # are special tokens must stay in the text (skip_special_tokens false), as vLLM's parsers ask.
        overrides = {**(constraint_for(req.tools, req.tool_choice, req.parallel_tool_calls) or {}),
                     **sampling_overrides(parsing)}
        return cls(parsing, overrides, key)

