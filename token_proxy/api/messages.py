"""A chat's prompt fields (messages, tools, documents, chat template and its options), validated into the
ChatPrompt the renderer takes: read by the chat endpoints and by /tokenize with `messages`."""

from __future__ import annotations

from token_proxy.api.fields import bad, opt_bool, opt_dict, opt_list, opt_str
from token_proxy.tokenization.renderer import ChatPrompt
from token_proxy.tools import messages_for_template

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def parse_chat_prompt(body: dict, uses_tools: bool = True) -> ChatPrompt:
    add_generation_prompt = opt_bool(body, "add_generation_prompt", True)
    continue_final_message = opt_bool(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise bad("continue_final_message",
                  "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    kwargs = opt_dict(body, "chat_template_kwargs")
    messages = parse_messages(body.get("messages"))
    return ChatPrompt(
        messages=messages_for_template(messages) if uses_tools else messages,
        tools=_parse_tools(body),
        documents=_parse_documents(body),
        chat_template=opt_str(body, "chat_template"),
        chat_template_kwargs=kwargs or None,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        add_special_tokens=opt_bool(body, "add_special_tokens", False),
    )


def parse_messages(messages: object) -> list[dict]:
    if not isinstance(messages, list):
        raise bad("messages", "must be an array of message objects")
    if not messages:
        raise bad("messages", "must contain at least one message")
    return [_parse_message(i, m) for i, m in enumerate(messages)]


def _parse_message(index: int, message: object) -> dict:
    if not isinstance(message, dict):
        raise bad("messages", f"message {index} must be an object")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad("messages", f"message {index} has an unknown role {role!r} "
                              f"(expected one of {', '.join(sorted(ROLES))})")
    out = dict(message)
    out["content"] = _parse_content(index, message.get("content"))
    if role == "assistant" and message.get("tool_calls") is not None:
        out["tool_calls"] = _parse_tool_calls(index, message["tool_calls"])
    return out


def _parse_content(index: int, content: object) -> str | None:
    """Strings pass; a list of text parts is joined with newlines, as vLLM does for string templates."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad("messages", f"message {index} content must be a string or an array of content parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
            raise bad("messages", f"message {index}: only text content parts are supported, got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_tool_calls(index: int, tool_calls: object) -> list:
    """Shape only; messages_for_template turns JSON-string arguments into objects, as vLLM does."""
    if not isinstance(tool_calls, list):
        raise bad("messages", f"message {index} tool_calls must be an array")
    for call in tool_calls:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise bad("messages", f"message {index}: each tool call needs a function object")
    return tool_calls


def _parse_tools(body: dict) -> list | None:
    tools = opt_list(body, "tools")
    if not tools:
        return None
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise bad("tools", f"tool {i} must be an object with a `function` object")
        if not isinstance(tool["function"].get("name"), str):
            raise bad("tools", f"tool {i} function needs a string `name`")
    return tools


def _parse_documents(body: dict) -> list | None:
    documents = opt_list(body, "documents")
    if documents and not all(isinstance(d, dict) for d in documents):
        raise bad("documents", "must be an array of objects")
    return documents or None
