"""bench/bench_vs_smg.py's pure parts: the bodies each front gets, the prompts, the CPU reading, the table."""

from __future__ import annotations

import json
import os

import orjson
import pytest

from tests.support.bench_modules import load_bench_module

bench = load_bench_module("bench_vs_smg")


def front(name: str):
    return bench.Front(name, "http://x", 1, "/v1/chat/completions",
                       "/inference/v1/generate" if name == "proxy" else "/generate")


def test_proxy_bodies_have_no_model_and_use_vllm_token_in():
    path, body = front("proxy").body("chat", True, 7, [])
    assert path == "/v1/chat/completions"
    assert orjson.loads(body) == {"messages": bench.chat_messages(7), "max_tokens": 16, "ignore_eos": True,
                                  "temperature": 0, "stream": True}
    path, body = front("proxy").body("token-in", False, 7, [5, 6])
    assert path == "/inference/v1/generate"
    assert orjson.loads(body) == {"token_ids": [5, 6], "stream": False,
                                  "sampling_params": {"max_tokens": 16, "ignore_eos": True, "temperature": 0}}


def test_smg_bodies_name_the_model_and_use_sglang_token_in():
    assert orjson.loads(front("smg").body("chat", False, 3, [])[1])["model"] == "bench"
    path, body = front("smg").body("token-in", True, 3, [9])
    assert path == "/generate"
    assert orjson.loads(body) == {"model": "bench", "input_ids": [9], "stream": True,
                                  "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0}}


def test_prompts_are_unique_and_about_200_tokens(hf_tokenizer):
    texts = [hf_tokenizer.apply_chat_template(bench.chat_messages(salt), add_generation_prompt=True, tokenize=False)
             for salt in (0, 1, 2)]
    assert len(set(texts)) == 3
    assert all(190 <= len(hf_tokenizer.encode(text, add_special_tokens=False)) <= 220 for text in texts)


def test_front_cpu_is_read_from_proc_stat():
    before = bench.proc_cpu_s(os.getpid())
    end = sum(i * i for i in range(300_000))
    assert end > 0 and bench.proc_cpu_s(os.getpid()) > before >= 0


def test_smg_tokenizer_folder_gets_a_config_json(tokenizer_dir, tmp_path):
    out = bench.smg_tokenizer_dir(str(tokenizer_dir), str(tmp_path))
    assert out == str(tmp_path / "qwen2")
    assert json.loads((tmp_path / "qwen2" / "config.json").read_text()) == bench.MODEL_CONFIG
    assert (tmp_path / "qwen2" / "tokenizer.json").is_file()


def test_table_has_a_row_per_path_and_front_and_the_chat_only_difference():
    cells = {(name, kind, stream): bench.Cell([1.0 if kind == "chat" else 0.6], [2.0], [100.0])
             for name in ("proxy", "smg") for kind, stream in bench.PATHS}
    text = bench.table(cells, 1)
    rows = [line for line in text.splitlines() if line.startswith(("| chat", "| token-in"))]
    assert len(rows) == 8
    assert rows[0] == "| chat `/v1/chat/completions` | no | proxy | 1.00 | 2.00 | 100 | yes |"
    assert "| token-in `/generate` | yes | smg | 0.60 | 2.00 | 100 | SGLang's (token-in only) |" in rows
    assert text.count("median of 1 rounds: 0.40 ms CPU per request") == 2


@pytest.mark.parametrize("salt", [0, 10**9])
def test_chat_messages_are_a_system_and_a_user_turn(salt):
    messages = bench.chat_messages(salt)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"].startswith(f"Request {salt}. ")
