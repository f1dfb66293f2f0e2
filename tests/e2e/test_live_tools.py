"""Tool calls through the proxy in front of a live SGLang (issue #12): tool_choice "required" is enforced
by SGLang's json_schema grammar, so even the GPU suite's tiny random model returns a schema-valid call,
parsed into vLLM's tool_calls; a 3-turn tool loop per parser family (the family's test template).

Run on a GPU host: SGLANG_URL=http://127.0.0.1:30000 pytest tests/e2e -m gpu
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

TEMPLATES = Path(__file__).parent.parent / "templates"
# Bounded documents (enums, no free strings), so a random model's constrained output stays short.
UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": UNIT}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
             "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("family", ["hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3"])
async def test_required_tool_loop_against_sglang(live_proxy, family):
    proxy = await live_proxy(tool_call_parser=family, enable_auto_tool_choice=True)
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    template = (TEMPLATES / f"{family}.jinja").read_text()
    messages = [{"role": "user", "content": "Weather, please."}]
    for _ in range(3):
        kwargs = {"model": model, "messages": messages, "tools": TOOLS, "tool_choice": "required",
                  "parallel_tool_calls": False, "max_tokens": 256, "temperature": 0,
                  "extra_body": {"chat_template": template, "return_token_ids": True}}
        r = await client.chat.completions.create(**kwargs)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        stream = await client.chat.completions.create(stream=True, **kwargs)
        deltas = [d async for c in stream if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert deltas[0].function.name == call.function.name
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(call.function.arguments)
        messages += [choice.message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
    await client.close()
