"""GET /openapi.json: an OpenAPI 3.1 description of the proxy's own inference and tokenizer routes.

The request schemas mirror the validators in token_proxy/schemas (types, ranges, required
fields), so a body the schema accepts is one the proxy takes, and one it refuses gets a 4xx.
Once SGLang is known, the served model name, the vocabulary size and the context length are
filled in, which lets fuzzers (tests/api/test_fuzz.py runs schemathesis) aim at real limits.
"""

from __future__ import annotations

from typing import NamedTuple

from aiohttp import web

from token_proxy import __version__
from token_proxy.api.completions.request import MAX_PROMPTS
from token_proxy.api.fields import INT64_MAX, INT64_MIN
from token_proxy.api.messages import ROLES
from token_proxy.api.sampling import MAX_STOP_STRINGS, RANGES, Range
from token_proxy.errors import BackendUnavailable
from token_proxy.http_io import json_response
from token_proxy.ids import MAX_ID_CHARS
from token_proxy.state import CONTEXT

ERROR_STATUSES = {
    "400": "Invalid request: the message names the parameter (`param`)",
    "401": "Missing or wrong API key (only when the proxy has one)",
    "404": "Unknown model",
    "413": "Body larger than the proxy's --max-body-bytes",
    "503": "SGLang unreachable, or the proxy is at capacity (Retry-After)",
    "502": "SGLang failed",
    "504": "SGLang timed out",
}


ALL_TOOL_CHOICES = ("auto", "required", "named")


class Limits(NamedTuple):
    model: str | None = None
    vocab_size: int | None = None
    max_model_len: int | None = None
    # The tool_choice values besides "none" that this proxy takes (tools/request.py's _check_parser):
    # all three with a tool-call parser and --enable-auto-tool-choice, else none. All three until SGLang
    # is known (its chat template may name the parser).
    tool_choices: tuple[str, ...] = ALL_TOOL_CHOICES


async def openapi_json(request: web.Request) -> web.Response:
    """Every path described here: the route table's `in_openapi` rows, exactly (tests/serving/
    test_route_table.py checks the two against each other once, not every request)."""
    return json_response(openapi_spec(_limits(request)))


def _limits(request: web.Request) -> Limits:
    ctx = request.app[CONTEXT]
    try:
        return Limits(ctx.served_model_name, ctx.tokenizer_info.vocab_size, ctx.max_model_len,
                      tool_choices(ctx.connection.get().tool_parser, ctx.settings.enable_auto_tool_choice))
    except BackendUnavailable:  # not connected yet: the same description without the engine's limits
        return Limits()


def tool_choices(tool_parser: str | None, auto_tool_choice: bool) -> tuple[str, ...]:
    """vLLM builds no tool parser without both flags, and then takes no tool_choice but "none"."""
    return ALL_TOOL_CHOICES if tool_parser is not None and auto_tool_choice else ()


def openapi_spec(limits: Limits | None = None) -> dict:
    s = _Schemas(limits or Limits())
    return {
        "openapi": "3.1.0",
        "info": {"title": "sglang-token-proxy", "version": __version__,
                 "description": "vLLM's OpenAI-compatible schema on top of SGLang's native /generate"},
        "paths": _paths(s),
        "components": {
            "schemas": {"Error": ERROR, "Message": s.message()},
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"apiKey": []}],  # the API key is optional (--api-key)
    }


def _paths(s: _Schemas) -> dict:
    return {
        "/v1/chat/completions": _post(s.chat(), _json_or_sse(s.chat_completion())),
        "/v1/chat/completions/tokens": _post(s.chat(tokens=True), _json_or_sse(s.chat_completion())),
        "/v1/chat/completions/render": _post(s.chat(), _json(s.rendered())),
        "/v1/completions": _post(s.completion(), _json_or_sse(s.text_completion())),
        "/inference/v1/generate": _post(s.generate(), _json_or_sse(s.generate_tokens())),
        **{f"{prefix}/tokenize": _post(s.tokenize(), _json(s.tokenized())) for prefix in ("", "/v1")},
        **{f"{prefix}/detokenize": _post(s.detokenize(), _json(s.detokenized())) for prefix in ("", "/v1")},
        "/v1/models": {"get": {"responses": {"200": _json(s.models())}}},
        "/health": {"get": {"security": [], "responses": {
            "200": {"description": "SGLang is healthy"},
            "503": _json({"$ref": "#/components/schemas/Error"}, "SGLang is not healthy")}}},
    }


ERROR = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": "integer", "description": "the HTTP status"}},
    }},
}


def _post(body: dict, ok: dict) -> dict:
    errors = {code: _json({"$ref": "#/components/schemas/Error"}, why) for code, why in ERROR_STATUSES.items()}
    return {"post": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                     "responses": {"200": ok, **errors}}}


def _json(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _json_or_sse(schema: dict) -> dict:
    return {"description": "The answer; with `stream: true`, server-sent events ending in `data: [DONE]`",
            "content": {"application/json": {"schema": schema}, "text/event-stream": {"schema": SSE_EVENT}}}


def _nullable(schema: dict) -> dict:
    """Every optional field may also be null, which the proxy reads as absent."""
    return {"anyOf": [schema, {"type": "null"}]}


def _int(lo: int | None = INT64_MIN, hi: int | None = INT64_MAX) -> dict:
    return {"type": "integer", **({} if lo is None else {"minimum": lo}), **({} if hi is None else {"maximum": hi})}


def _num(lo: float, hi: float, *, exclusive_lo: bool = False) -> dict:
    return {"type": "number", ("exclusiveMinimum" if exclusive_lo else "minimum"): lo, "maximum": hi}


def _ranged(r: Range) -> dict:
    """A field of api/sampling.py's RANGES, as parse_sampling checks it."""
    if r.integer:
        return _int(INT64_MIN if r.lo is None else r.lo, INT64_MAX if r.hi is None else r.hi)
    return _num(r.lo, r.hi, exclusive_lo=r.exclusive_lo)


def _range(key: str) -> dict:
    return _ranged(RANGES[key])


def _given(key: str, schema: dict) -> dict:
    """The body has `key`, matching `schema` (a null one is absent, as the parsers read it)."""
    return {"required": [key], "properties": {key: schema}}


def _implies(condition: dict, consequence: dict) -> dict:
    """A rule across fields that the parsers check (JSON Schema's if/then)."""
    return {"if": condition, "then": consequence}


def below(n: int) -> str:
    """A regex for the decimal integers in [0, n) (n >= 1), leading zeros allowed (int() reads them)."""
    top = str(n - 1)
    options = ["0"] + [f"[1-9][0-9]{{{k}}}" for k in range(len(top) - 1)]
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            options.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
    options.append(top)
    return "^0*(?:" + "|".join(options) + ")$"


BOOL = {"type": "boolean"}
STR = {"type": "string"}
OBJ = {"type": "object"}
NON_EMPTY_STR = {"type": "string", "minLength": 1}
REQUEST_ID = {"type": "string", "maxLength": MAX_ID_CHARS, "pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]*$",
              "description": "no control characters; becomes the SGLang rid and the X-Request-Id header"}
# One server-sent event: `data` is a JSON chunk, or [DONE] last.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
STREAM_OPTIONS = {"type": "object", "description": "only with stream: true",
                  "properties": {"include_usage": _nullable(BOOL), "continuous_usage_stats": _nullable(BOOL)}}
# The parsers' rules across fields (api/fields.py, api/sampling.py, api/messages.py, tools/request.py).
STREAM_OPTIONS_NEED_STREAM = _implies(_given("stream_options", OBJ), _given("stream", {"const": True}))
TOP_LOGPROBS_NEED_LOGPROBS = _implies(_given("top_logprobs", {"type": "integer", "minimum": 1}),
                                      _given("logprobs", {"const": True}))
CONTINUE_NEEDS_NO_GENERATION_PROMPT = _implies(_given("continue_final_message", {"const": True}),
                                               _given("add_generation_prompt", {"const": False}))
# parse_sampling's one constraint: response_format's and structured_outputs' are not both given.
_CONSTRAINT_KINDS = ("json", "regex", "grammar", "choice")
_GIVEN = {"not": {"anyOf": [{"type": "null"}, {"const": []}]}}
_ABSENT = {"anyOf": [{"type": "null"}, {"const": []}]}
ONE_CONSTRAINT = _implies(
    _given("response_format", {"required": ["type"], "properties": {
        "type": {"enum": ["json_object", "json_schema", "structural_tag"]}}}),
    {"properties": {"structured_outputs": {"anyOf": [
        {"type": "null"}, {"properties": dict.fromkeys(_CONSTRAINT_KINDS, _ABSENT)}]}}})
TOOL_CHOICE_NEEDS_TOOLS = _implies(_given("tool_choice", {"not": {"anyOf": [{"type": "null"}, {"const": "none"}]}}),
                                   _given("tools", {"type": "array"}))


class _Schemas:
    """Request and response schemas, with the engine's limits where they are known."""

    def __init__(self, limits: Limits):
        self.limits = limits
        top = None if limits.vocab_size is None else limits.vocab_size - 1
        self.token_id = _int(0, top)
        # logit_bias's keys: token ids in decimal (ASCII digits), below the vocabulary size once known
        self.token_key = "^[0-9]+$" if limits.vocab_size is None else below(limits.vocab_size)
        self.max_tokens = _int(RANGES["max_tokens"].lo, limits.max_model_len or INT64_MAX)
        self.model = STR if limits.model is None else {"type": "string", "enum": [limits.model]}

    def token_ids(self, min_items: int = 1) -> dict:
        return {"type": "array", "items": self.token_id, "minItems": min_items}

    def sampling(self, *, chat: bool) -> dict:
        """parse_sampling: chat's logprobs is a flag (+ top_logprobs); elsewhere it is a count."""
        logprobs = {"logprobs": BOOL, "top_logprobs": _range("top_logprobs")} if chat else {
            "logprobs": _range("top_logprobs")}
        fields = {
            "n": _range("n"), "max_tokens": self.max_tokens, "max_completion_tokens": self.max_tokens,
            "min_tokens": {**self.max_tokens, "minimum": RANGES["min_tokens"].lo, "description": "<= max_tokens"},
            **{key: _range(key) for key in ("temperature", "top_p", "top_k", "min_p",
                                            "frequency_penalty", "presence_penalty", "repetition_penalty")},
            "stop": {"anyOf": [NON_EMPTY_STR, {"type": "array", "items": NON_EMPTY_STR,
                                               "maxItems": MAX_STOP_STRINGS}]},
            "stop_token_ids": self.token_ids(min_items=0), "include_stop_str_in_output": BOOL,
            "ignore_eos": BOOL, "seed": _range("seed"),
            "logit_bias": {"type": "object", "propertyNames": {"pattern": self.token_key},
                           "additionalProperties": {"type": "number"}},
            "skip_special_tokens": BOOL, "spaces_between_special_tokens": BOOL,
            "response_format": self.response_format(), "structured_outputs": self.structured_outputs(),
            **logprobs, "prompt_logprobs": _range("prompt_logprobs"),
            # Refused (400) when set to anything but these.
            "use_beam_search": {"const": False}, "best_of": {"const": 1},
        }
        return {k: _nullable(v) for k, v in fields.items()}

    @staticmethod
    def response_format() -> dict:
        json_schema = {"type": "object", "properties": {"schema": OBJ}, "description": "{\"schema\": {...}}"}
        return {"type": "object", "properties": {
            "type": {"enum": ["text", "json_object", "json_schema", "structural_tag"]},
            "json_schema": {"description": "read only with type json_schema"}},
            **_implies(_given("type", {"const": "json_schema"}), _given("json_schema", json_schema))}

    @staticmethod
    def structured_outputs() -> dict:
        kinds = _CONSTRAINT_KINDS
        two = [{"required": [a, b], "properties": {a: _GIVEN, b: _GIVEN}}
               for i, a in enumerate(kinds) for b in kinds[i + 1:]]
        return {"type": "object", "description": "one of json, regex, grammar, choice", "properties": {
            "json": _nullable({"type": ["string", "object"], "description": "a JSON schema (SGLang compiles it)"}),
            "regex": _nullable(STR), "grammar": _nullable(STR),
            "choice": _nullable({"type": "array", "items": STR})}, "not": {"anyOf": two}}

    def message(self) -> dict:
        part = {"anyOf": [STR, {"type": "object", "required": ["type", "text"],
                                "properties": {"type": {"enum": ["text", "input_text"]}, "text": STR}}]}
        return {"type": "object", "required": ["role"], "properties": {
            "role": {"enum": sorted(ROLES)},
            "content": {"anyOf": [STR, {"type": "null"}, {"type": "array", "items": part}]},
            # Checked on assistant messages only (an array of calls); other roles pass it to the template.
            "tool_calls": {"description": "on assistant messages, an array of {\"function\": {...}}"},
        }}

    def chat_prompt(self) -> dict:
        """parse_chat_prompt: what renders the messages (shared by chat and /tokenize)."""
        tool = {"type": "object", "required": ["function"], "properties": {
            "function": {"type": "object", "required": ["name"], "properties": {"name": STR}}}}
        fields = {
            "tools": {"type": "array", "items": tool}, "documents": {"type": "array", "items": OBJ},
            "chat_template": STR, "chat_template_kwargs": OBJ,
            "add_generation_prompt": BOOL, "continue_final_message": BOOL, "add_special_tokens": BOOL,
        }
        return {"messages": {"type": "array", "items": {"$ref": "#/components/schemas/Message"}, "minItems": 1},
                **{k: _nullable(v) for k, v in fields.items()}}

    def chat_tools(self) -> dict:
        """Chat-only fields: tools' use (/tokenize renders tools but ignores these) and the session key."""
        named = {"type": "object", "required": ["function"], "properties": {
            "type": {"enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {"name": NON_EMPTY_STR},
                         "description": "names one of `tools`"}}}
        tool_choice = {
            "description": "vLLM's: \"none\" (tools still rendered unless --exclude-tools-when-tool-choice-none), "
                           "\"auto\" (the default with tools; needs --enable-auto-tool-choice and a tool-call "
                           "parser), \"required\" or a named function (forced by a json_schema constraint)",
            "anyOf": [{"enum": ["none", *(c for c in ("auto", "required") if c in self.limits.tool_choices)]},
                      *([named] if "named" in self.limits.tool_choices else [])]}
        fields = {"tool_choice": tool_choice, "parallel_tool_calls": BOOL, "include_reasoning": BOOL,
                  "session_id": {"type": "string", "maxLength": MAX_ID_CHARS,
                                 "description": "session continuity key (or the X-Session-ID header)"}}
        return {k: _nullable(v) for k, v in fields.items()}

    def tool_rules(self) -> list[dict]:
        """Without a tool parser and --enable-auto-tool-choice, tools need tool_choice "none" (absent is "auto")."""
        if "auto" in self.limits.tool_choices:
            return []
        return [_implies(_given("tools", {"type": "array"}), _given("tool_choice", {"const": "none"}))]

    def request_fields(self) -> dict:
        return {k: _nullable(v) for k, v in {
            "model": self.model, "request_id": REQUEST_ID, "cache_salt": STR, "priority": _int(),
        }.items()}

    def output_fields(self) -> dict:
        return {k: _nullable(v) for k, v in {
            "stream": BOOL, "stream_options": STREAM_OPTIONS, "return_token_ids": BOOL,
            "return_tokens_as_token_ids": BOOL, "truncate_prompt_tokens": _int(1),
        }.items()}

    def chat(self, *, tokens: bool = False) -> dict:
        props = {**self.request_fields(), **self.chat_prompt(), **self.chat_tools(), **self.sampling(chat=True),
                 **self.output_fields()}
        tool = {"type": "object", "required": ["function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {"name": STR}}}}
        props["tools"] = _nullable({"type": "array", "items": tool, "minItems": 1})  # /tokenize takes []
        required = ["messages"]
        if tokens:  # the prompt is these ids; the messages only give context (tools, template)
            props["tokens"] = self.token_ids()
            required.append("tokens")
        return {"type": "object", "required": required, "properties": props,
                "allOf": [STREAM_OPTIONS_NEED_STREAM, TOP_LOGPROBS_NEED_LOGPROBS,
                          CONTINUE_NEEDS_NO_GENERATION_PROMPT, TOOL_CHOICE_NEEDS_TOOLS, ONE_CONSTRAINT,
                          *self.tool_rules()],
                "description": "continue_final_message needs add_generation_prompt: false; "
                               "top_logprobs > 0 needs logprobs: true; min_tokens <= max_tokens"}

    def completion(self) -> dict:
        prompt = {"anyOf": [
            NON_EMPTY_STR,
            {"type": "array", "items": NON_EMPTY_STR, "minItems": 1, "maxItems": MAX_PROMPTS},
            self.token_ids(),
            {"type": "array", "items": self.token_ids(), "minItems": 1, "maxItems": MAX_PROMPTS},
        ]}
        props = {**self.request_fields(), "prompt": prompt, "echo": _nullable(BOOL),
                 "add_special_tokens": _nullable(BOOL), "suffix": {"type": "null"},
                 **self.sampling(chat=False), **self.output_fields()}
        return {"type": "object", "required": ["prompt"], "properties": props, "allOf": [STREAM_OPTIONS_NEED_STREAM, ONE_CONSTRAINT],
                "description": "min_tokens <= max_tokens"}

    def generate(self) -> dict:
        params = {"type": "object", "properties": self.sampling(chat=False), **ONE_CONSTRAINT}
        props = {**self.request_fields(), "token_ids": self.token_ids(), "sampling_params": _nullable(params),
                 "stream": _nullable(BOOL), "stream_options": _nullable(STREAM_OPTIONS),
                 "output_mode": _nullable({"const": "tokens"})}
        return {"type": "object", "required": ["token_ids"], "properties": props}

    def tokenize(self) -> dict:
        """A chat (`messages`) or plain text (`prompt`)."""
        common = {"model": _nullable(self.model), "return_token_strs": _nullable(BOOL)}
        chat = {"type": "object", "required": ["messages"], "properties": {**common, **self.chat_prompt()},
                "allOf": [CONTINUE_NEEDS_NO_GENERATION_PROMPT]}
        plain = {"type": "object", "required": ["prompt"], "properties": {
            **common, "prompt": STR, "add_special_tokens": _nullable(BOOL)}}
        return {"anyOf": [chat, plain]}

    def detokenize(self) -> dict:
        return {"type": "object", "required": ["tokens"],
                "properties": {"model": _nullable(self.model), "tokens": self.token_ids(min_items=0)}}

    # Responses: the keys clients rely on (vLLM's full shapes carry more, mostly null).

    @staticmethod
    def usage() -> dict:
        count = {"type": "integer", "minimum": 0}
        return {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                "properties": {"prompt_tokens": count, "completion_tokens": count, "total_tokens": count}}

    def _completion_like(self, obj: str, choice: dict) -> dict:
        return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                "properties": {"id": STR, "object": {"const": obj}, "created": {"type": "integer"},
                               "model": self.model, "usage": self.usage(),
                               "choices": {"type": "array", "minItems": 1, "items": choice}}}

    def chat_completion(self) -> dict:
        message = {"type": "object", "required": ["role", "content"],
                   "properties": {"role": {"const": "assistant"}, "content": STR}}
        choice = {"type": "object", "required": ["index", "message", "finish_reason"], "properties": {
            "index": {"type": "integer"}, "message": message, "finish_reason": STR,
            "token_ids": {"anyOf": [{"type": "array", "items": self.token_id}, {"type": "null"}]}}}
        return self._completion_like("chat.completion", choice)

    def text_completion(self) -> dict:
        choice = {"type": "object", "required": ["index", "text", "finish_reason"],
                  "properties": {"index": {"type": "integer"}, "text": STR, "finish_reason": STR}}
        return self._completion_like("text_completion", choice)

    def generate_tokens(self) -> dict:
        choice = {"type": "object", "required": ["index", "token_ids", "finish_reason"], "properties": {
            "index": {"type": "integer"}, "token_ids": {"type": "array", "items": self.token_id},
            "finish_reason": STR}}
        return {"type": "object", "required": ["request_id", "model", "choices", "usage", "prompt_token_ids"],
                "properties": {"request_id": STR, "model": self.model, "usage": self.usage(),
                               "prompt_token_ids": {"type": "array", "items": self.token_id},
                               "choices": {"type": "array", "minItems": 1, "items": choice}}}

    def tokenized(self) -> dict:
        return {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"], "properties": {
            "count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": self.token_id},
            "token_strs": {"anyOf": [{"type": "array", "items": STR}, {"type": "null"}]}}}

    def rendered(self) -> dict:
        """vLLM's GenerateRequest (api/chat/render.py): every key present, None where unset."""
        keys = ["request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params",
                "model", "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode",
                "parse_context", "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params",
                "ec_transfer_params"]
        return {"type": "object", "required": keys, "properties": {
            "request_id": STR, "token_ids": {"type": "array", "items": self.token_id},  # a template may render nothing
            "sampling_params": {"type": "object"},
            "output_mode": {"const": "tokens"}, "parse_context": {"type": "object"}}}

    @staticmethod
    def detokenized() -> dict:
        return {"type": "object", "required": ["prompt"], "properties": {"prompt": STR}}

    def models(self) -> dict:
        card = {"type": "object", "required": ["id", "object", "max_model_len"], "properties": {
            "id": self.model, "object": {"const": "model"}, "max_model_len": {"type": "integer"}}}
        return {"type": "object", "required": ["object", "data"],
                "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": card}}}
