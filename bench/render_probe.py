"""A chat's render and tokenize, each stage alone: transformers' apply_chat_template, the compiled Jinja2
template alone, minijinja (Rust; a compiled piece this project does not use, measured as a proposal), and the
proxy's encoders, on the built-in Qwen2 template with a two-message ~200-word chat (bench_vs_smg.py's shape).
Checks that every renderer gives the same text and both encoders the same ids before timing them.

    python bench/render_probe.py                         # without minijinja: its row is skipped
    pip install --target /tmp/mj minijinja && MINIJINJA_PATH=/tmp/mj python bench/render_probe.py
"""

from __future__ import annotations

import os
import sys
import time

from jinja2.sandbox import ImmutableSandboxedEnvironment

from token_proxy.simulator.builtin_tokenizer import ensure_builtin_tokenizer
from token_proxy.tokenization.fast_bpe import load_fast_bpe
from token_proxy.tokenization.loader import load_tokenizer
from token_proxy.tokenization.renderer import text_encoder


def best_us(fn, n: int = 3000, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return min(times)


def main() -> None:
    tok = load_tokenizer(str(ensure_builtin_tokenizer()))
    text = " ".join(f"w{(7 * 7919 + i) % 997}" for i in range(190))
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]
    variables = {"messages": messages, "add_generation_prompt": True, "bos_token": "", "eos_token": "<|im_end|>"}
    rows = {"transformers apply_chat_template": lambda: tok.apply_chat_template(messages, tokenize=False,
                                                                                 add_generation_prompt=True)}
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(tok.chat_template)
    rows["the compiled Jinja2 template alone"] = lambda: template.render(**variables)
    if os.environ.get("MINIJINJA_PATH"):
        sys.path.insert(0, os.environ["MINIJINJA_PATH"])
        import minijinja

        env = minijinja.Environment(templates={"chat": tok.chat_template})
        env.trim_blocks, env.lstrip_blocks = True, True
        rows["minijinja (Rust)"] = lambda: env.render_template("chat", **variables)
    rendered = {name: fn() for name, fn in rows.items()}
    prompt = rendered["transformers apply_chat_template"]
    assert len(set(rendered.values())) == 1, "the renderers disagree"
    backend, twin = text_encoder(tok), text_encoder(tok, load_fast_bpe(tok))
    assert backend(prompt, False) == twin(prompt, False)
    rows["encode: tokenizers' encode_batch_fast"] = lambda: backend(prompt, False)
    rows["encode: the tiktoken twin (the proxy's, ASCII)"] = lambda: twin(prompt, False)
    print(f"prompt: {len(prompt)} characters, {len(twin(prompt, False))} tokens; best of 5 rounds, µs per call\n")
    print("| stage | µs |\n|---|---:|")
    for name, fn in rows.items():
        print(f"| {name} | {best_us(fn, 300 if name.startswith('encode') else 3000):.1f} |")


if __name__ == "__main__":
    main()
