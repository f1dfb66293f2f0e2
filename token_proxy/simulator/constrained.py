"""SGLang's constraints, simulated: for `json_schema` the output is a JSON document that satisfies the schema
(`regex` and `ebnf`: a text they accept, grammar_text.py).

Real SGLang masks logits with a grammar; the simulator instead picks one deterministic
instance of the schema (varied by the prompt, so different prompts pick different
`anyOf` branches, e.g. different tools of a "required" call), tokenizes it, and the
sequence emits those tokens and then EOS. `max_new_tokens` still cuts it short, as it
would cut a real constrained generation.

A sampled sequence also varies with its `sampling_seed`, or without one with its index among the reply's
samples, as sampling under a grammar does: n samples differ where the constraint leaves a choice (branches,
enum values, strings), and one seed always gives one answer. A greedy one is the prompt's alone.
"""

from __future__ import annotations

import json
from dataclasses import replace

from token_proxy.simulator.grammar_text import ebnf_text, regex_text

_MAX_DEPTH = 8


def forced_output_ids(json_schema: str, prompt: list[int], encode, variant: int = 0) -> tuple[int, ...]:
    """The token ids of a document valid under `json_schema` (a JSON string, as SGLang takes it); `variant`:
    the sample's own part of the choices (see _variant)."""
    schema = json.loads(json_schema)  # JSONDecodeError is a ValueError: see with_forced_outputs
    if not isinstance(schema, dict):
        raise ValueError("the schema is not a JSON object")  # noqa: TRY004 (a bad value, reported as SGLang does)
    seed = sum(prompt) + len(prompt) + variant
    value = _Instance(schema, seed, variant).of(schema, 0)
    return tuple(encode(json.dumps(value, ensure_ascii=False)))


def _variant(spec) -> int:
    """What a sample adds to the prompt's choices: greedy nothing (one answer, as a greedy decode under a
    grammar); sampled with a seed, the seed (one seed, one answer; the proxy seeds n samples seed, seed+1, ...);
    sampled without one, its index in the reply, so n samples differ (deterministic, for tests)."""
    params = spec.params
    if params.greedy:
        return 0
    return params.sampling_seed % 2**31 if params.sampling_seed is not None else spec.index


def with_forced_outputs(sequences: list, encode, scripted_output: str | None = None) -> list:
    """SequenceSpecs with `forced_ids` set where their sampling_params carry a constraint (json_schema,
    regex or ebnf), or, for the others, to `scripted_output`'s ids when the simulator is configured with one.

    A constraint that does not compile aborts the request as SGLang's grammar manager does
    (FINISH_ABORT, 400 BadRequestError, "Failed to compile json grammar: ...", "... regex grammar: ...").
    """
    scripted = tuple(encode(scripted_output)) if scripted_output else ()
    return [_constrained(spec, encode) if _constraint(spec.params)
            else replace(spec, forced_ids=scripted) if scripted else spec for spec in sequences]


def _constraint(params) -> tuple[str, str] | None:
    """(SGLang's grammar key, its value): the one constraint a request may carry."""
    for key in ("json_schema", "regex", "ebnf"):
        if getattr(params, key):
            return key, getattr(params, key)
    return None


def _constrained(spec, encode):
    key, value = _constraint(spec.params)
    variant = _variant(spec)
    seed = sum(spec.prompt) + len(spec.prompt) + variant
    try:
        if key == "json_schema":
            forced = forced_output_ids(value, spec.prompt, encode, variant)
        else:
            forced = tuple(encode(regex_text(value, seed) if key == "regex" else ebnf_text(value, seed)))
        return replace(spec, forced_ids=forced)
    except ValueError as exc:
        name = "json" if key == "json_schema" else key
        return replace(spec, input_error=f"Failed to compile {name} grammar: {exc}")


class _Instance:
    def __init__(self, root: dict, seed: int, variant: int = 0):
        self._root, self._seed, self._variant = root, seed, variant

    def of(self, schema: object, depth: int) -> object:
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return None if depth > _MAX_DEPTH else {}
        if "$ref" in schema:
            return self.of(self._resolve(schema["$ref"]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if schema.get("enum"):
            return schema["enum"][self._seed % len(schema["enum"])]
        for key in ("anyOf", "oneOf"):
            if schema.get(key):
                options = schema[key]
                merged = {k: v for k, v in schema.items() if k != key}
                return self.of({**merged, **options[self._seed % len(options)]}, depth + 1)
        if schema.get("allOf"):
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                merged.update(part)
            return self.of(merged, depth + 1)
        return self._typed(schema, _type_of(schema), depth)

    def _typed(self, schema: dict, kind: str, depth: int) -> object:
        if kind == "object":
            props = schema.get("properties") or {}
            return {name: self.of(sub, depth + 1) for name, sub in props.items()}
        if kind == "array":
            count = max(schema.get("minItems", 1), 1)
            count = min(count, schema.get("maxItems", count))
            items = schema.get("items") or {}
            return [self.of(items, depth + 1) for _ in range(count)]
        if kind == "string":
            text = f"sim{self._variant % 997}" if self._variant else "sim"  # samples differ in strings too
            return text.ljust(schema.get("minLength", 0), "x")[: schema.get("maxLength", 1 << 30)]
        if kind in ("integer", "number"):
            low = schema.get("minimum", schema.get("exclusiveMinimum", 0) + (1 if "exclusiveMinimum" in schema else 0))
            return max(int(low), 1) if "maximum" not in schema else min(max(int(low), 1), int(schema["maximum"]))
        if kind == "boolean":
            return True
        return None

    def _resolve(self, ref: str) -> dict:
        node: object = self._root
        for part in ref.lstrip("#/").split("/"):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        return node if isinstance(node, dict) else {}


def _type_of(schema: dict) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "object"
    return kind
