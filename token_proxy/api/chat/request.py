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
from token_proxy.api.sampling import SamplingRequest, parse_sampling
from token_proxy.tokenization.renderer import ChatPrompt
from token_proxy.tools import tools_for_template, validate_tools


@dataclass(frozen=True, slots=True)
class ToolFlags:
    """The server's tool flags a chat request is checked against (vLLM's)."""

    tool_call_parser: str | None = None  # the chosen parser (flag or chat template)
    enable_auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False


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
    prompt = parse_chat_prompt(body)
    tools, tool_choice = body.get("tools"), body.get("tool_choice")
    validate_tools(tools, tool_choice, tool_parser=tool_flags.tool_call_parser,
                   auto_tool_choice=tool_flags.enable_auto_tool_choice)
    rendered_tools = tools_for_template(prompt.tools, tool_choice, tool_flags.exclude_tools_when_tool_choice_none)
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
