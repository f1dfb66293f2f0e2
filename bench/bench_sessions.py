"""Turn-k prompt cost with and without a session: tokenization stays flat as the history grows.

Builds one conversation (a ~30-token user message and a ~300-token sampled answer per turn) with the
offline Qwen2 tokenizer, and at chosen turns times the prompt step both ways (median of --repeat):

- session: `SessionStore.prompt_ids` (renders the template on the conversation, hashes, and encodes
  only the text after the previous completion);
- full: today's chat path without a cache (render the template, encode the whole text).

"encode" columns are tokenizer time alone; "total" adds Jinja rendering and hashing, which stay
linear in the history (text work, ~10x cheaper per character than BPE). Usage:

    python bench/bench_sessions.py [--turns 1 2 4 8 16 32 64] [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from token_proxy.sessions import SessionStore, TemplateCodec
from token_proxy.simulator.builtin_tokenizer import ensure_builtin_tokenizer
from token_proxy.tokenization.renderer import ChatPrompt, render_chat_text

EOS = 151645
ANSWER = ("Here is a considered answer about colours, turn {k}: teal, ochre, and a muted sage green that "
          "works well with warm wood. ") * 12


class TimedTokenizer:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.encode_s = 0.0
        self.encoded_chars = 0

    def encode(self, text, **kwargs):
        start = time.perf_counter()
        ids = self._tokenizer.encode(text, **kwargs)
        self.encode_s += time.perf_counter() - start
        self.encoded_chars += len(text)
        return ids

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def sampled(tokenizer, text):
    return [i for k in range(0, len(text), 3) for i in tokenizer.encode(text[k:k + 3])] + [EOS]


def measure(fn, timed: TimedTokenizer, repeat: int) -> tuple[float, float, int]:
    totals, encodes = [], []
    for _ in range(repeat):
        timed.encode_s, timed.encoded_chars = 0.0, 0
        start = time.perf_counter()
        fn()
        totals.append(time.perf_counter() - start)
        encodes.append(timed.encode_s)
    return statistics.median(encodes) * 1e3, statistics.median(totals) * 1e3, timed.encoded_chars


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    path = ensure_builtin_tokenizer(Path(tempfile.mkdtemp()) / "qwen2")
    raw = AutoTokenizer.from_pretrained(str(path))
    timed = TimedTokenizer(raw)
    store = SessionStore()
    messages: list[dict] = []
    print(f"{'turn':>5} {'history tok':>11} | {'session encode ms':>17} {'chars':>6} {'total ms':>8} | "
          f"{'full encode ms':>14} {'chars':>7} {'total ms':>8} | outcome")
    for k in range(1, max(args.turns) + 1):
        messages.append({"role": "user", "content": f"Turn {k}: name a few colours that go with oak?"})
        codec = TemplateCodec(timed, ChatPrompt(messages=list(messages)))
        plan = store.prompt_ids("bench", list(messages), codec)
        if k in args.turns:
            s_enc, s_total, s_chars = measure(lambda c=codec: store.prompt_ids("bench", list(messages), c), timed,
                                              args.repeat)
            prompt = ChatPrompt(messages=list(messages))
            f_enc, f_total, f_chars = measure(
                lambda p=prompt: timed.encode(render_chat_text(timed, p), add_special_tokens=False), timed, args.repeat)
            print(f"{k:>5} {len(plan.ids):>11} | {s_enc:>17.3f} {s_chars:>6} {s_total:>8.3f} | "
                  f"{f_enc:>14.3f} {f_chars:>7} {f_total:>8.3f} | {plan.outcome.header_value()}")
        text = ANSWER.format(k=k)
        store.record(plan, sampled(raw, text), "stop", {"role": "assistant", "content": text})
        messages.append({"role": "assistant", "content": text})


if __name__ == "__main__":
    main()
