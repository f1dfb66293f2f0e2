"""deepseek_v3: DeepSeek V3 / R1's special-token layout.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGS
    ```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>

As vLLM's DeepSeekV3ToolParser: content is the text before the calls block plus the text
after it; arguments are kept as the model wrote them (here: only when they are valid JSON).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from token_proxy.tools.calls import FunctionCall, IdFactory, vllm_call_id
from token_proxy.tools.formats.hermes import tagged_regions
from token_proxy.tools.formats.scan import Scan, content_before, is_json

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(r"(?P<type>.*)<｜tool▁sep｜>(?P<name>.*)\n```json\n(?P<args>[\s\S]*?)\n```$")


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
        start = text.find(CALLS_BEGIN)
        content = content_before(text, start, final, (CALLS_BEGIN,))
        if start < 0:
            return Scan(content)
        end = text.find(CALLS_END, start)
        block = text[start + len(CALLS_BEGIN) : end if end >= 0 else len(text)]
        calls = [_call(body) for body in tagged_regions(block, CALL_BEGIN, CALL_END, final=False)]
        if end >= 0:
            after = text[end + len(CALLS_END) :]
            content += content_before(after, -1, final, (CALLS_BEGIN,))
        return Scan(content, [call for call in calls if call is not None])
