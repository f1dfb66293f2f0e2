"""One deterministic text a `regex` or `ebnf` constraint accepts, for the simulator (SGLang masks logits with
xgrammar; the simulator writes one accepted text instead, as constrained.py does for json_schema).

The choice among alternatives turns on `seed` (the prompt), so different prompts can pick different
branches; repetitions take their minimum (at least one for `+`), so the text is short and generation ends.
"""

from __future__ import annotations

import re

try:  # Python 3.11+
    from re import _constants as sre_constants
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover -- Python 3.10
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

_MAX_DEPTH = 40
_SEEDED_DEPTH = 6  # below it alternatives follow the seed; deeper, the first (the base case, usually)


def regex_text(pattern: str, seed: int) -> str:
    """A string that `re.fullmatch(pattern, ...)` accepts; ValueError if the pattern does not compile."""
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise ValueError(f"invalid regex {pattern!r}: {exc}") from None
    return _Regex(seed).items(parsed)


class _Regex:
    def __init__(self, seed: int):
        self._seed, self._groups = seed, {}

    def items(self, items) -> str:
        return "".join(self.item(op, av) for op, av in items)

    def item(self, op, av) -> str:
        c = sre_constants
        if op is c.LITERAL:
            return chr(av)
        if op is c.NOT_LITERAL:
            return "a" if av != ord("a") else "b"
        if op is c.ANY:
            return "a"
        if op is c.IN:
            return self.charset(av)
        if op is c.BRANCH:
            options = av[1]
            return self.items(options[self._seed % len(options)])
        if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
            low, _, sub = av
            return self.items(sub) * low
        if op is c.SUBPATTERN:
            group, sub = av[0], av[-1]
            text = self.items(sub)
            if group:
                self._groups[group] = text
            return text
        if op is c.GROUPREF:
            return self._groups.get(av, "")
        if op in (c.AT, c.ASSERT, c.ASSERT_NOT):
            return ""
        raise ValueError(f"unsupported regex construct {op}")

    @staticmethod
    def charset(items) -> str:
        c = sre_constants
        if items and items[0][0] is c.NEGATE:
            excluded = {chr(av) for op, av in items[1:] if op is c.LITERAL}
            return next(ch for ch in "abcxyz0" if ch not in excluded)
        for op, av in items:
            if op is c.LITERAL:
                return chr(av)
            if op is c.RANGE:
                return chr(av[0])
            if op is c.CATEGORY:
                return {c.CATEGORY_DIGIT: "0", c.CATEGORY_SPACE: " "}.get(av, "a")
        return "a"


# --- EBNF (xgrammar's GBNF dialect, as SGLang's `ebnf` takes it) ----------------------------------------

_TOKEN = re.compile(r'''\s*(?:(?P<string>"(?:[^"\\]|\\.)*")|(?P<chars>\[(?:[^\]\\]|\\.)*\])|(?P<name>[A-Za-z_][\w-]*)'''
                    r'''|(?P<op>::=|[|()*+?]))''')


def ebnf_text(grammar: str, seed: int) -> str:
    """A string the grammar's `root` rule accepts; ValueError for a grammar this reader cannot follow."""
    rules = _rules(grammar)
    if "root" not in rules:
        raise ValueError("the grammar has no root rule")
    return _Ebnf(rules, seed).rule("root", 0)


def _rules(grammar: str) -> dict[str, list]:
    tokens, pos = [], 0
    text = re.sub(r"#[^\n]*", "", grammar)
    while pos < len(text):
        if not text[pos:].strip():
            break
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"cannot read the grammar at {text[pos:pos + 20]!r}")
        tokens.append((match.lastgroup, match.group(match.lastgroup)))
        pos = match.end()
    rules: dict[str, list] = {}
    starts = [i for i in range(len(tokens) - 1) if tokens[i][0] == "name" and tokens[i + 1] == ("op", "::=")]
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(tokens)
        body, used = _alternatives(tokens[start + 2:end], 0)
        if used != end - start - 2:
            raise ValueError(f"cannot read rule {tokens[start][1]}")
        rules[tokens[start][1]] = body
    return rules


def _alternatives(tokens, i):
    options, sequence = [], []
    while i < len(tokens) and tokens[i] != ("op", ")"):
        if tokens[i] == ("op", "|"):
            options.append(sequence)
            sequence, i = [], i + 1
            continue
        if tokens[i] == ("op", "("):
            inner, i = _alternatives(tokens, i + 1)
            term = ("group", inner)
            i += 1  # the ")"
        else:
            term, i = tokens[i], i + 1
        if i < len(tokens) and tokens[i] in (("op", "*"), ("op", "+"), ("op", "?")):
            term, i = ("repeat", (term, tokens[i][1])), i + 1
        sequence.append(term)
    options.append(sequence)
    return options, i


class _Ebnf:
    def __init__(self, rules: dict, seed: int):
        self._rules, self._seed = rules, seed

    def rule(self, name: str, depth: int) -> str:
        if name not in self._rules:
            raise ValueError(f"the grammar uses an undefined rule {name}")
        return self.options(self._rules[name], depth + 1)

    def options(self, options: list, depth: int) -> str:
        if depth > _MAX_DEPTH:
            raise ValueError("the grammar recurses too deeply")
        # deep down, the first alternative (usually the base case) ends the recursion
        chosen = options[self._seed % len(options)] if depth < _SEEDED_DEPTH else options[0]
        return "".join(self.term(term, depth) for term in chosen)

    def term(self, term, depth: int) -> str:
        kind, value = term
        if kind == "string":
            return value[1:-1].encode().decode("unicode_escape")
        if kind == "chars":
            return _Regex.charset(sre_parse.parse(value)[0][1])
        if kind == "name":
            return self.rule(value, depth)
        if kind == "group":
            return self.options(value, depth + 1)
        inner, quantifier = value  # repeat
        return self.term(inner, depth) if quantifier == "+" else ""
