"""deepseek_v3: DeepSeek V3 / R1's special-token layout.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGS
    ```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>

As vLLM's DeepSeekV3ToolParser: content is the text before the calls block plus the text
after it; arguments are kept as the model wrote them (here: only when they are valid JSON).

Streamed (`progress`) as vLLM's streaming parser does: the header once the name's line has
ended and the ```json fence has begun (vLLM: at the name's newline), then the arguments as
written, as far as they are valid JSON (vLLM sends what its regex sees, minus a last newline
or backtick). An open call counts only once `<｜tool▁call▁end｜>` closes it, as in `scan`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from token_proxy.tools.calls import FunctionCall, IdFactory, vllm_call_id
from token_proxy.tools.formats.hermes import tagged_regions
from token_proxy.tools.formats.json_prefix import JsonHead, raw_head
from token_proxy.tools.formats.scan import CallProgress, Scan, content_before, is_json, split_at

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
_CALL = re.compile(r"(?P<type>.*)<｜tool▁sep｜>(?P<name>.*)\n```json\n(?P<args>[\s\S]*?)\n```$")
_NAME_LINE = re.compile(r"(?P<type>.*)<｜tool▁sep｜>(?P<name>.*)\n")
FENCE = "```json\n"


def _call(body: str) -> FunctionCall | None:
    match = _CALL.match(body)
    if match is None or not is_json(match["args"]):
        return None
    return FunctionCall(match["name"], match["args"])


@dataclass(frozen=True)
class DeepSeekV3Format:
    name: str = "deepseek_v3"
    new_id: IdFactory = vllm_call_id
    triggers: str = '<'  # first characters of the markers (see ToolFormat)
    prefix_content: bool = False  # see ToolFormat

    def scan(self, text: str, final: bool, tools: list | None) -> Scan:
        content, start = split_at(text, CALLS_BEGIN, final)
        if start < 0:
            return Scan(content)
        end = text.find(CALLS_END, start)
        block = text[start + len(CALLS_BEGIN) : end if end >= 0 else len(text)]
        calls = [_call(body) for body in tagged_regions(block, CALL_BEGIN, CALL_END, final=False)]
        if end >= 0:
            after = text[end + len(CALLS_END) :]
            content += content_before(after, -1, final, (CALLS_BEGIN,))
        return Scan(content, [call for call in calls if call is not None])

    def progress(self, text: str, final: bool, tools: list | None, memo: dict | None = None) -> list[CallProgress]:
        """The closed calls `scan` finds, and an open one with its name: its arguments as written so
        far, as far as they are valid JSON (`memo` keeps its JsonHead)."""
        memo = {} if memo is None else memo
        start = text.find(CALLS_BEGIN)
        if start < 0:
            return []
        end = text.find(CALLS_END, start)
        block_start = start + len(CALLS_BEGIN)
        block = text[block_start : end if end >= 0 else len(text)]
        calls, pos = [], 0
        while (call_start := block.find(CALL_BEGIN, pos)) >= 0:
            body_start = call_start + len(CALL_BEGIN)
            call_end = block.find(CALL_END, body_start)
            if call_end >= 0:
                call = _call(block[body_start:call_end])
                if call is not None:
                    calls.append(CallProgress(call.name, call.arguments))
                pos = call_end + len(CALL_END)
                continue
            body = block[body_start:]
            name = _NAME_LINE.match(body)
            after = body[name.end():] if name and end < 0 else None
            if after is not None and after.startswith(FENCE):
                head = memo.setdefault(block_start + body_start, JsonHead())
                calls.append(CallProgress(name["name"], _raw_with_lead(head, after[len(FENCE):], final)))
            elif after is not None and FENCE.startswith(after):
                calls.append(CallProgress(name["name"], ""))
            break
        return calls


def _raw_with_lead(head: JsonHead, text: str, final: bool) -> str:
    """raw_head, with the blank text before the value (deepseek_v3 keeps it in the arguments)."""
    fixed = raw_head(head, text, final)
    return text[: len(text) - len(text.lstrip())] + fixed if fixed else ""
