"""The part of json.dumps(value) already fixed by a prefix of the value's JSON text.

A streamed call's arguments are sent as fragments of the text the finished call will carry,
json.dumps(arguments, ensure_ascii=False) (vLLM's re-serialisation), so the joined fragments
equal the non-streamed arguments. `stable_dump(text)` re-serialises the tokens complete so
far: structure as json.dumps writes it (", " and ": "), strings up to the last complete
character of a value (escaping is per character, so its head is final), numbers only once a
delimiter ends them (`1` may still become `10`, `1.0e1` re-serialises as `10.0`).

Pure and stdlib-only: a regex per token (a long string is one step), not a dependency on
partial_json_parser, whose completed guesses (`{"a": "x` -> `{"a": "x"}`) are not prefixes anyway.
Keys are sent whole. Exception (shared with vLLM's own stream): an object repeating a key.
json.loads keeps the last value at the first key's place, so the head stops before the repeat
and text already sent no longer matches the final arguments.
"""

from __future__ import annotations

import json
import re

_WS = re.compile(r"[ \t\n\r]*")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # a run of string characters with no escape
_ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")


def _dump_chars(chars: str) -> str:
    return json.dumps(chars, ensure_ascii=False)[1:-1]


def stable_dump(text: str, final: bool = False) -> tuple[str, int | None]:
    """(the fixed head of json.dumps of the value `text` starts with, where the value ends or None).

    `final`: nothing more will come (a number at the very end is then complete). Invalid JSON
    stops the head where it went wrong (end None): the call will not parse, nothing more is fixed.
    """
    out: list[str] = []
    stack: list[str] = []  # "{" or "[" per open container
    keys: list[set] = []  # the keys of each open object, innermost last
    expect = "value"  # value | key | colon | comma (after a value inside a container)
    pos = _WS.match(text).end()
    n = len(text)
    while pos < n:
        char = text[pos]
        if expect == "colon":
            if char != ":":
                return "".join(out), None
            out.append(": ")
            expect, pos = "value", pos + 1
        elif expect == "comma":
            if char == ",":
                out.append(", ")
                expect, pos = ("key" if stack[-1] == "{" else "value"), pos + 1
            elif char == ("}" if stack[-1] == "{" else "]"):
                out.append(char)
                if stack.pop() == "{":
                    keys.pop()
                pos += 1
                if not stack:
                    return "".join(out), pos
            else:
                return "".join(out), None
        elif char == '"' and expect in ("value", "key"):
            mark = len(out)
            end = _string(text, pos + 1, out)
            if end is None:
                return "".join(out), None
            if end < 0:  # unterminated: a value's head is out; a key waits (it may repeat one)
                if expect == "key":
                    del out[mark:]
                return "".join(out), None
            pos = end
            if expect == "key":
                key = json.loads("".join(out[mark:]))
                if key in keys[-1]:  # a repeated key: json.loads moves its value to the first place
                    del out[mark:]
                    return "".join(out), None
                keys[-1].add(key)
                expect = "colon"
            elif not stack:
                return "".join(out), pos
            else:
                expect = "comma"
        elif expect == "key":
            if char == "}" and out and out[-1] == "{":  # {} (no key after a comma)
                out.append("}")
                stack.pop()
                keys.pop()
                pos += 1
                if not stack:
                    return "".join(out), pos
                expect = "comma"
            else:
                return "".join(out), None
        elif char in "{[":
            out.append(char)
            stack.append(char)
            if char == "{":
                keys.append(set())
            expect, pos = ("key" if char == "{" else "value"), pos + 1
        elif char == "]" and stack and stack[-1] == "[" and out[-1] == "[":  # []
            out.append("]")
            stack.pop()
            pos += 1
            if not stack:
                return "".join(out), pos
            expect = "comma"
        else:
            match = _NUMBER.match(text, pos)
            if match:
                if (match.end() == n and not final) or text[match.end():match.end() + 1] in tuple(".eE+-0123456789"):
                    return "".join(out), None  # still arriving (`1` of `10`), or malformed (`01`)
                token = match.group()
                out.append(json.dumps(json.loads(token)))
            else:
                token = next((lit for lit in _LITERALS if text.startswith(lit, pos)), None)
                if token is None:
                    return "".join(out), None  # a literal still arriving, or not JSON
                out.append(token)
            pos += len(token)
            if not stack:
                return "".join(out), pos
            expect = "comma"
        pos = _WS.match(text, pos).end()
    return "".join(out), None


def _string(text: str, pos: int, out: list[str]) -> int | None:
    """Append the string starting after its quote at `pos`; its end, -1 while open, None if invalid."""
    out.append('"')
    n = len(text)
    while pos < n:
        plain = _PLAIN.match(text, pos)
        if plain:
            out.append(_dump_chars(plain.group()))
            pos = plain.end()
            continue
        char = text[pos]
        if char == '"':
            out.append('"')
            return pos + 1
        if char != "\\":
            return None  # a raw control character: json.loads refuses it
        escape = _ESCAPE.match(text, pos)
        if escape is None:
            return -1 if n - pos < 6 and _could_be_escape(text[pos:]) else None
        code = escape.group()
        if code[1] == "u" and 0xD800 <= _code_point(code) < 0xDC00:  # a high surrogate: wait for its pair
            pair = _ESCAPE.match(text, escape.end())
            if pair is None and n - escape.end() < 6 and _could_be_escape(text[escape.end():] or "\\"):
                return -1
            if pair and pair.group()[1] == "u" and 0xDC00 <= _code_point(pair.group()) < 0xE000:
                code += pair.group()
        out.append(_dump_chars(json.loads(f'"{code}"')))
        pos += len(code)
    return -1


def _code_point(escape: str) -> int:
    return int(escape.removeprefix("\\u"), 16)


def _could_be_escape(head: str) -> bool:
    return re.fullmatch(r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{0,4})?', head) is not None
