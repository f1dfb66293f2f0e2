"""Exact multi-turn prefixes: the next turn's prompt is the previous prompt ids + the completion ids.

Re-rendering the assistant's text through the chat template can give other ids than
the model produced (BPE merges the text differently; templates rewrite past turns),
which silently corrupts training data. The token-in paths keep the prefix bit-for-bit.
"""

from __future__ import annotations

import orjson

from token_proxy.simulator import SIM_STATE

EOS = 151645
USER1 = {"role": "user", "content": "Name a colour."}
USER2 = {"role": "user", "content": "Another one?"}
# The ChatML text that follows an assistant turn's <|im_end|> and opens the next one.
NEXT_TURN = "\n<|im_start|>user\nAnother one?<|im_end|>\n<|im_start|>assistant\n"
# A Qwen3-style template: past assistant turns lose their <think> block when re-rendered.
THINKING_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- set c = m['content'] %}"
    "{%- if m['role'] == 'assistant' and not loop.last %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


async def post(client, path, body):
    resp = await client.post(path, data=orjson.dumps(body))
    assert resp.status == 200, await resp.text()
    return orjson.loads(await resp.read())


async def tokenize(proxy, **body):
    return (await post(proxy, "/tokenize", body))["tokens"]


async def first_turn_that_retokenizes_differently(proxy, hf_tokenizer):
    """A sampled turn whose text, re-encoded, is not the ids the model produced."""
    prompt = await tokenize(proxy, messages=[USER1])
    for seed in range(40):
        out = await post(proxy, "/inference/v1/generate", {
            "token_ids": prompt, "sampling_params": {"max_tokens": 40, "min_tokens": 12, "temperature": 1.0,
                                                     "seed": seed, "logit_bias": {str(EOS): 100}}})
        completion = out["choices"][0]["token_ids"]
        assert completion[-1] == EOS and len(completion) == 13
        text = hf_tokenizer.decode(completion[:-1])
        if hf_tokenizer.encode(text) != completion[:-1]:
            return prompt, completion, text
    raise AssertionError("no sampled turn re-tokenized differently in 40 seeds")


async def test_token_in_paths_keep_the_previous_turn_bit_for_bit(proxy, sim, hf_tokenizer):
    prompt1, completion1, text1 = await first_turn_that_retokenizes_differently(proxy, hf_tokenizer)
    exact_prefix = prompt1 + completion1

    # Re-rendering the conversation (what a chat-only client does) changes the ids of turn 1:
    rerendered = await tokenize(proxy, messages=[USER1, {"role": "assistant", "content": text1}, USER2])
    assert rerendered[: len(exact_prefix)] != exact_prefix
    assert hf_tokenizer.decode(rerendered) == hf_tokenizer.decode(exact_prefix + await tokenize(
        proxy, prompt=NEXT_TURN, add_special_tokens=False))  # same text, different ids

    # Token in: previous prompt + the completion ids as produced + the next turn's ids.
    turn2 = exact_prefix + await tokenize(proxy, prompt=NEXT_TURN, add_special_tokens=False)
    state = sim.app[SIM_STATE]
    await post(proxy, "/inference/v1/generate", {"token_ids": turn2, "sampling_params": {"max_tokens": 2}})
    assert state.received[-1]["input_ids"] == turn2
    out = await post(proxy, "/v1/completions", {"prompt": turn2, "max_tokens": 2, "return_token_ids": True})
    assert state.received[-1]["input_ids"] == turn2
    assert out["choices"][0]["prompt_token_ids"] == turn2
    out = await post(proxy, "/v1/chat/completions/tokens", {"messages": [USER1, USER2], "tokens": turn2,
                                                            "max_tokens": 2, "return_token_ids": True})
    assert state.received[-1]["input_ids"] == turn2
    assert out["prompt_token_ids"][: len(exact_prefix)] == exact_prefix


async def test_template_that_rewrites_past_turns(proxy, sim, hf_tokenizer):
    prompt1 = await tokenize(proxy, messages=[USER1], chat_template=THINKING_TEMPLATE)
    completion1 = hf_tokenizer.encode("<think>\nRed or blue?\n</think>\n\nBlue.") + [EOS]
    text1 = hf_tokenizer.decode(completion1[:-1])
    rerendered = await tokenize(proxy, messages=[USER1, {"role": "assistant", "content": text1}, USER2],
                                chat_template=THINKING_TEMPLATE)
    exact_prefix = prompt1 + completion1
    assert rerendered[: len(exact_prefix)] != exact_prefix  # the <think> block is gone
    turn2 = exact_prefix + await tokenize(proxy, prompt=NEXT_TURN, add_special_tokens=False)
    out = await post(proxy, "/v1/chat/completions/tokens", {
        "messages": [USER1, USER2], "tokens": turn2, "chat_template": THINKING_TEMPLATE, "max_tokens": 2,
        "return_token_ids": True})
    assert out["prompt_token_ids"] == turn2
    assert sim.app[SIM_STATE].received[-1]["input_ids"] == turn2
