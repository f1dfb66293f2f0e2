"""Session continuity on the chat path (issue #16; the logic is token_proxy/sessions).

A chat request with a session key (`X-Session-ID` header or `session_id` body field) gets its prompt
ids from the session store: the stored prompt + completion ids of the previous turn followed by the
ids of the new messages only, or a full render with the reason. The outcome goes out as the
`X-Session-Continuity` header and the `session_continuity` response field; the turn the client got
is recorded after the response (single-choice requests only), in the tokenizer executor; the session's
next lookup waits for it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from token_proxy.errors import InvalidRequest
from token_proxy.http_io import json_response, read_json, response_headers
from token_proxy.pipeline.request_state import RequestStats
from token_proxy.sessions import (
    HEADER,
    Fallback,
    SessionCollector,
    SessionOutcome,
    SessionPlan,
    SessionStore,
    TemplateCodec,
)
from token_proxy.sessions.keys import SESSION_ID_FIELD, SESSION_ID_HEADER, session_key
from token_proxy.state import REGISTER_COLLECTOR, SETTINGS, Upstream
from token_proxy.tokenization.renderer import ChatPrompt
from token_proxy.vocabulary import Output, Usage

SESSIONS = web.AppKey("sessions", SessionStore)  # absent when --session-max-bytes is 0
# With --workers N, on the admin owner: drop a session in every serving process, True if one held it
# (serving/owner_news.py sets it; /finish_session is an owner row). Absent in one process.
FINISH_EVERYWHERE = web.AppKey("finish_everywhere", Callable[[str], Awaitable[bool]])
_RECORDED = ("stop", "length", "tool_calls")


def add_sessions(app: web.Application) -> None:
    """The store on the app and its metrics (call after add_observability: it sets REGISTER_COLLECTOR)."""
    settings = app[SETTINGS]
    if settings.session_max_bytes <= 0:
        return
    store = SessionStore(settings.session_max_count, settings.session_ttl_s, settings.session_max_bytes)
    app[SESSIONS] = store
    app[REGISTER_COLLECTOR](SessionCollector(store))


async def finish_session(request: web.Request) -> web.Response:
    """SkyRL's `POST /finish_session?session_id=ID` (RemoteInferenceClient.finish_session, at the end of a
    trajectory): the session's stored turn is dropped now rather than at its TTL. An unknown id, or sessions
    off, is a no-op, as SkyRL's routers answer it. With --workers N each serving process keeps its own
    sessions: the call goes to the owner, which drops the session in every process before it answers."""
    body = await read_json(request) if request.can_read_body else {}
    key = session_key({SESSION_ID_HEADER: request.query[SESSION_ID_FIELD]} if SESSION_ID_FIELD in request.query
                      else request.headers, body if isinstance(body, dict) else {})
    if key is None:
        raise InvalidRequest(f"{SESSION_ID_FIELD} is required (query, body or the {SESSION_ID_HEADER} header)",
                             param=SESSION_ID_FIELD)
    store = request.app.get(SESSIONS)
    held = store is not None and store.forget(key)
    everywhere = request.app.get(FINISH_EVERYWHERE)
    if everywhere is not None and store is not None:
        held = await everywhere(key) or held
    return json_response({"session_id": key, "finished": bool(held)})


class ChatSession:
    """One session request: plans its prompt ids, reports the outcome, records the returned turn."""

    def __init__(self, request: web.Request, store: SessionStore, key: str):
        self._request = request
        self.store = store
        self.key = key
        self.plan: SessionPlan | None = None
        self.outcome: SessionOutcome | None = None
        self._executor = None

    @classmethod
    def of(cls, request: web.Request, key: str) -> ChatSession | None:
        """`key`: ChatFeatures' checked session key (a bad key is a 400 even with sessions off)."""
        store = request.app.get(SESSIONS)
        return cls(request, store, key) if store is not None else None

    async def prompt_ids(self, ctx: Upstream, prompt: ChatPrompt, stats: RequestStats) -> list[int]:
        start = time.perf_counter()
        self._executor = ctx.renderer.executor
        self.plan = await self.store.prompt_ids_async(ctx.renderer.executor, self.key, prompt.messages,
                                                      TemplateCodec(ctx.renderer.tokenizer, prompt,
                                                                    ctx.renderer.encoder))
        stats.render_s = time.perf_counter() - start
        self._report(self.plan.outcome)
        return self.plan.ids

    def unsupported(self, prompt_tokens: int) -> None:
        """A session request whose prompt is not the rendered messages (truncate_prompt_tokens): full
        render, nothing recorded."""
        self._report(SessionOutcome.fallback(Fallback.UNSUPPORTED_REQUEST, prompt_tokens))

    def field(self) -> dict | None:
        return self.outcome.as_field() if self.outcome is not None else None

    def recorder(self, formatter, n: int):
        """`formatter`, recording the returned turn when there is one to record."""
        if self.plan is None or self.plan.rendering is None or n != 1:
            return formatter
        return RecordingFormatter(formatter, self.store, self.plan, self._executor)

    def _report(self, outcome: SessionOutcome) -> None:
        self.outcome = outcome
        response_headers(self._request)[HEADER] = outcome.header_value()


class RecordingFormatter:
    """A chat formatter that records the single choice it returned: its completion ids, vLLM's finish
    reason and the assistant message as the client got it (for streams, assembled from the deltas)."""

    plain_chunks = False  # every chunk is recorded

    def __init__(self, inner, store: SessionStore, plan: SessionPlan, executor):
        self._inner = inner
        self._store = store
        self._plan = plan
        self._executor = executor
        self._ids: list[int] = []
        self._texts: dict[str, list[str]] = {"content": []}  # the deltas' text, joined once at the end
        self._calls: dict[int, dict] = {}
        self._finish: str | None = None

    def response(self, outputs: list[Output], usage: Usage) -> dict:
        body = self._inner.response(outputs, usage)
        choice = body["choices"][0] if len(outputs) == 1 else None
        if choice is not None and choice["finish_reason"] in _RECORDED:
            self._store.record_soon(self._executor, self._plan, list(outputs[0].token_ids), choice["finish_reason"],
                                    choice["message"])
        return body

    def start(self) -> list[dict]:
        return self._inner.start()

    def chunk(self, out: Output) -> dict | None:
        chunk = self._inner.chunk(out)
        self._ids += out.token_ids
        if chunk is not None:
            choice = chunk["choices"][0]
            self._add_delta(choice["delta"])
            self._finish = choice["finish_reason"] or self._finish
        return chunk

    def finish(self, usage: Usage) -> list[dict]:
        """The stream ended normally: record what was sent."""
        if self._finish in _RECORDED:
            message = {"role": "assistant", **{key: "".join(parts) or None for key, parts in self._texts.items()}}
            if self._calls:
                message["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
            self._store.record_soon(self._executor, self._plan, self._ids, self._finish, message)
        return self._inner.finish(usage)

    def _add_delta(self, delta: dict) -> None:
        for key in ("content", "reasoning"):
            if delta.get(key):
                self._texts.setdefault(key, []).append(delta[key])
        for call in delta.get("tool_calls") or ():
            entry = self._calls.setdefault(call["index"], {"id": None, "type": "function",
                                                           "function": {"name": None, "arguments": ""}})
            if call.get("id"):
                entry["id"] = call["id"]
            function = call.get("function") or {}
            if function.get("name"):
                entry["function"]["name"] = function["name"]
            entry["function"]["arguments"] += function.get("arguments") or ""
