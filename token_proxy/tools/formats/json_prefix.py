"""The part of json.dumps(value) already fixed by a prefix of the value's JSON text.

A streamed call's arguments are sent as fragments of the text the finished call will carry,
json.dumps(arguments, ensure_ascii=False) (vLLM's re-serialisation), so the joined fragments
equal the non-streamed arguments. `JsonHead.advance(text)` re-serialises the tokens complete
so far: structure as json.dumps writes it (", " and ": "), a string value up to its last
complete character (escaping is per character, so its head is final), keys whole, numbers only
once a delimiter ends them (`1` may still become `10`; `1.0e1` re-serialises as `10.0`).

Incremental: fed a text that extends the last one, it resumes at the last complete token (or
inside an open string), and a string is one regex and one json.loads (C speed), so a stream
costs about what its text does. Stdlib only: partial_json_parser's completed guesses
(`{"a": "x` -> `{"a": "x"}`) are not prefixes of the result anyway.

Exception (shared with vLLM's own stream): an object repeating a key. json.loads keeps the last
value at the first key's place, so the head stops before the repeat, and what was already sent
no longer matches the final arguments.
"""

from __future__ import annotations

import json
import re

_WS = re.compile(r"[ \t\n\r]*")
# A string's body as far as it is complete: plain characters and whole escapes.
_BODY = re.compile(r'(?:[^"\\\x00-\x1f]+|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*')
_HIGH_TAIL = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}$")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_GOES_ON = tuple(".eE+-0123456789")
_LITERALS = ("true", "false", "null")


def _dump_chars(chars: str) -> str:
    return json.dumps(chars, ensure_ascii=False)[1:-1]


class JsonHead:
    """One JSON value's fixed head, advanced as its text grows (state kept at token boundaries)."""

    def __init__(self) -> None:
        self._text = ""  # the text last advanced over (a later one must extend it, else restart)
        self._out: list[str] = []  # the head's pieces, for complete tokens
        self._stack: list[str] = []  # "{" or "[" per open container
        self._keys: list[set] = []  # the keys of each open object, innermost last
        self._expect = "value"  # value | key | colon | comma (after a value inside a container)
        self._pos = 0  # where to go on in _text
        self._open_string: str | None = None  # the head of an open string value ('"' + chars so far)
        self.end: int | None = None  # where the value ended, once it has

    @property
    def head(self) -> str:
        return "".join(self._out) + (self._open_string or "")

    @property
    def raw_end(self) -> int:
        """How far the text last advanced over is fixed as written: where the value ended, else the
        end of its last complete token (inside an open string, of its last complete character).
        For formats that keep arguments as the model wrote them (mistral v11, deepseek_v3, a named
        function): that text's prefix is a prefix of the finished call's arguments."""
        return self.end if self.end is not None else self._pos

    def advance(self, text: str, final: bool = False) -> tuple[str, int | None]:
        """(the fixed head of json.dumps of the value `text` starts with, where the value ends or None).

        `final`: nothing more will come (a number at the very end is then complete). Invalid JSON
        stops the head where it went wrong: the call will not parse, nothing more is fixed.
        """
        if not text.startswith(self._text):
            self.__init__()
        self._text = text
        if self.end is not None or (self._open_string is not None and not self._string(text)):
            return self.head, self.end  # done, or still inside a string value
        if self.end is None:
            self._tokens(text, final)
        return self.head, self.end

    def _tokens(self, text: str, final: bool) -> None:
        """Every complete token from _pos on into the head; stops at one still arriving, or not JSON."""
        out, stack, n = self._out, self._stack, len(text)
        while (pos := _WS.match(text, self._pos).end()) < n:
            char, expect = text[pos], self._expect
            if expect == "colon":
                if char != ":":
                    return
                out.append(": ")
                self._expect, pos = "value", pos + 1
            elif expect == "comma":
                pos = self._after_value(char, pos)
            elif expect == "key":
                pos = self._key(text, char, pos)
            elif char == '"':
                self._open_string, self._pos = '"', pos + 1
                if not self._string(text):
                    return
                pos = self._pos
            elif char in "{[":
                pos = self._open(char, pos)
            elif char == "]" and stack and stack[-1] == "[" and out[-1] == "[":  # []
                pos = self._close(char, pos)
            else:
                token = self._scalar(text, pos, final)
                if token is None:
                    return  # still arriving (`1` of `10`, `tr`), or not JSON
                pos += len(token)
                self._value_done(pos)
            if pos is None:
                return
            self._pos = pos
            if self.end is not None:
                return

    def _after_value(self, char: str, pos: int) -> int | None:
        """After a value inside a container: a comma, or the container's close."""
        closer = "}" if self._stack[-1] == "{" else "]"
        if char == ",":
            self._out.append(", ")
            self._expect = "key" if closer == "}" else "value"
            return pos + 1
        return self._close(char, pos) if char == closer else None

    def _key(self, text: str, char: str, pos: int) -> int | None:
        """Where a key is expected: a whole key (it goes out whole: it may repeat one), or `{}`'s `}`."""
        if char != '"':
            if char != "}" or self._out[-1] != "{":  # `{}`; no `}` after a comma
                return None
            return self._close(char, pos)
        match = _BODY.match(text, pos + 1)
        if text[match.end():match.end() + 1] != '"':
            return None
        key = json.loads(text[pos:match.end() + 1])
        keys = self._keys[-1]
        if key in keys:  # json.loads would move the value to the first place
            return None
        keys.add(key)
        self._out.append(json.dumps(key, ensure_ascii=False))
        self._expect = "colon"
        return match.end() + 1

    def _open(self, char: str, pos: int) -> int:
        self._out.append(char)
        self._stack.append(char)
        if char == "{":
            self._keys.append(set())
        self._expect = "key" if char == "{" else "value"
        return pos + 1

    def _scalar(self, text: str, pos: int, final: bool) -> str | None:
        match = _NUMBER.match(text, pos)
        if match:
            after = text[match.end():match.end() + 1]
            if (not after and not final) or after in _NUMBER_GOES_ON:
                return None
            self._out.append(json.dumps(json.loads(match.group())))
            return match.group()
        token = next((lit for lit in _LITERALS if text.startswith(lit, pos)), None)
        if token is not None:
            self._out.append(token)
        return token

    def _close(self, char: str, pos: int) -> int:
        self._out.append(char)
        if self._stack.pop() == "{":
            self._keys.pop()
        self._value_done(pos + 1)
        return pos + 1

    def _value_done(self, pos: int) -> None:
        if not self._stack:
            self.end = pos
        self._expect = "comma"

    def _string(self, text: str) -> bool:
        """Go on with the open string value at _pos; True once it closed (then _pos is after it)."""
        pos = self._pos
        body = _BODY.match(text, pos)
        raw, end = body.group(), body.end()
        closed = text[end:end + 1] == '"'
        if not closed and (high := _HIGH_TAIL.search(raw)) and _escapes(raw, high.start()):
            raw, end = raw[: high.start()], pos + high.start()  # a high surrogate waits for its low half
        self._open_string += _dump_chars(json.loads(f'"{raw}"'))
        if not closed:
            # The rest is a partial escape, or a raw control character / bad escape (json.loads
            # refuses it: the call will not parse): either way nothing more is fixed now.
            self._pos = end
            return False
        self._out.append(self._open_string + '"')
        self._open_string = None
        self._value_done(end + 1)
        self._pos = end + 1
        return True


def _escapes(raw: str, at: int) -> bool:
    """Whether the backslash at `at` starts an escape (an even run of backslashes before it)."""
    return (at - len(raw[:at].rstrip("\\"))) % 2 == 0


def raw_head(head: JsonHead, text: str, final: bool) -> str:
    """The fixed part of the JSON value `text` starts with, as written (from its first non-blank
    character); `head` is the stream's JsonHead for this value (see JsonHead.raw_end)."""
    head.advance(text, final)
    lead = len(text) - len(text.lstrip())
    return text[lead:head.raw_end] if head.raw_end > lead else ""
