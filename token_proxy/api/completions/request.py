"""POST /v1/completions: the request body, validated (vLLM's defaults: max_tokens 16, special tokens added)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from token_proxy.api.fields import (
    OutputOptions,
    bad,
    opt_bool,
    opt_int,
    opt_request_id,
    opt_str,
    parse_output_options,
    token_id_list,
)
from token_proxy.api.sampling import parse_sampling
from token_proxy.vocabulary import SamplingRequest

DEFAULT_MAX_TOKENS = 16  # vLLM's (and OpenAI's) completions default; chat's is the rest of the context
MAX_PROMPTS = 1024


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str | None
    prompts: list  # each a string or a list of token ids
    sampling: SamplingRequest
    output: OutputOptions
    echo: bool = False
    add_special_tokens: bool = True
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    truncate_prompt_tokens: int | None = None


def parse_completion_request(body: dict, vocab_size: int) -> CompletionRequest:
    if body.get("suffix") is not None:
        raise bad("suffix", "suffix is not supported")
    sampling = parse_sampling(body, vocab_size, logprobs_count=True)
    if sampling.max_tokens is None:  # absent or null
        sampling = replace(sampling, max_tokens=DEFAULT_MAX_TOKENS)
    echo = opt_bool(body, "echo", False)
    if echo and sampling.logprobs and sampling.prompt_logprobs is None:
        sampling = replace(sampling, prompt_logprobs=sampling.top_logprobs)  # vLLM echoes prompt logprobs
    return CompletionRequest(
        model=opt_str(body, "model"),
        prompts=parse_prompts(body.get("prompt"), vocab_size),
        sampling=sampling,
        output=parse_output_options(body),
        echo=echo,
        add_special_tokens=opt_bool(body, "add_special_tokens", True),
        request_id=opt_request_id(body),
        cache_salt=opt_str(body, "cache_salt"),
        priority=opt_int(body, "priority"),
        truncate_prompt_tokens=opt_int(body, "truncate_prompt_tokens", lo=1),
    )


def parse_prompts(prompt: object, vocab_size: int) -> list:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [token_id_list(p, "prompt", vocab_size) for p in prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = [token_id_list(prompt, "prompt", vocab_size)]
    else:
        raise bad("prompt", "Either prompt or prompt_embeds must be provided and non-empty.")
    if len(prompts) > MAX_PROMPTS:
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    if any(p == "" for p in prompts):
        raise bad("prompt", "Either prompt or prompt_embeds must be provided and non-empty.")
    return prompts
