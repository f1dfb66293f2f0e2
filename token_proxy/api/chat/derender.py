"""POST /v1/chat/completions/derender: vLLM's derenderer (vllm/entrypoints/scale_out/derender), the
counterpart of /v1/chat/completions/render. Token ids an engine generated come back as the whole chat
response /v1/chat/completions would have sent: detokenized, tool calls and reasoning parsed for the
`chat_request` (the request /render was given), finish and stop reasons, usage. No engine is called.

Non-streaming, as vLLM documents it (`stream: true` is a 400 naming `stream`). The generated ids go through
the same output rules and chat formatter as an SGLang reply, as if SGLang had answered them.
"""

from __future__ import annotations

import dataclasses

from aiohttp import web

from token_proxy.api.chat.endpoint import output_parser, tool_flags
from token_proxy.api.chat.format import ChatFormatter
from token_proxy.api.chat.request import ChatFeatures, parse_chat_request
from token_proxy.api.fields import bad, opt_int, opt_request_id, opt_str, token_id_list
from token_proxy.http_io import json_response, read_json
from token_proxy.pipeline.request_state import new_request_id, now
from token_proxy.pipeline.run import output_rules
from token_proxy.state import upstream_of
from token_proxy.vocabulary import ResponseMeta

_PLACEHOLDER_CHAT = {"messages": [{"role": "user", "content": ""}]}
_FINISHES = ("stop", "length", "abort", None)


async def chat_completions_derender(request: web.Request) -> web.Response:
    ctx = upstream_of(request.app)
    body = await read_json(request)
    if body.get("stream"):
        raise bad("stream", "streaming derender is not supported: send the whole generate_response, stream false")
    vocab = ctx.tokenizer_info.vocab_size
    generated = body.get("generate_response")
    if not isinstance(generated, dict) or not isinstance(generated.get("choices"), list) or not generated["choices"]:
        raise bad("generate_response", "generate_response must be an object with a non-empty `choices` list")
    chat_body = body.get("chat_request") if body.get("chat_request") is not None else _PLACEHOLDER_CHAT
    if not isinstance(chat_body, dict):
        raise bad("chat_request", "chat_request must be the chat completion request given to /render")
    flags = tool_flags(ctx)
    req = parse_chat_request(chat_body, vocab, flags)
    features = ChatFeatures.for_request(req, chat_body, None, flags)
    prompt_ids = token_id_list(body["prompt_token_ids"], "prompt_token_ids", vocab, allow_empty=True) \
        if body.get("prompt_token_ids") is not None else []
    prompt_tokens = opt_int(body, "prompt_tokens", len(prompt_ids), lo=0)
    items = [_as_sglang_reply(choice, i, ctx.token_texts, vocab, req.sampling.skip_special_tokens, prompt_tokens)
             for i, choice in enumerate(generated["choices"])]
    sampling = dataclasses.replace(req.sampling, n=len(items))
    rules = output_rules(ctx, sampling, 1, prompt_tokens, False)
    outputs = rules.whole(items)
    rid = opt_request_id(generated) or new_request_id("chatcmpl", None)
    meta = ResponseMeta(rid if rid.startswith("chatcmpl-") else f"chatcmpl-{rid}", now(),
                        opt_str(body, "model") or ctx.served_model_name, [prompt_ids])
    return json_response(ChatFormatter(req, meta, None, output_parser(req, features)).response(outputs, rules.usage()))


def _as_sglang_reply(choice, position: int, texts, vocab: int, skip_special: bool, prompt_tokens: int) -> dict:
    """One generated choice as SGLang's /generate would have answered it."""
    if not isinstance(choice, dict):
        raise bad("generate_response", f"choices[{position}] must be an object")
    ids = token_id_list(choice.get("token_ids"), f"generate_response.choices[{position}].token_ids", vocab,
                        allow_empty=True)
    finish = choice.get("finish_reason")
    if finish not in _FINISHES:
        raise bad("generate_response", f"choices[{position}].finish_reason must be stop, length, abort or null")
    stop_reason = choice.get("stop_reason")
    matched = stop_reason if stop_reason is not None else (ids[-1] if ids else None)
    sglang_finish = {"stop": {"type": "stop", "matched": matched}, "length": {"type": "length", "length": len(ids)},
                     "abort": {"type": "abort", "message": "aborted"}, None: None}[finish]
    index = choice.get("index", position)
    return {"index": index if isinstance(index, int) else position, "text": texts.decode(ids, skip_special),
            "output_ids": ids, "meta_info": {"id": str(position), "finish_reason": sglang_finish,
                                             "prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                                             "cached_tokens": 0}}
