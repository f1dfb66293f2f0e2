"""Session continuity (issue #16): exact multi-turn prompt ids for clients that send only messages.

    key = session_key(request.headers, body)  # None: not a session request
    plan = await store.prompt_ids_async(executor, key, messages, TemplateCodec(tokenizer, chat_prompt))
    ... generate with plan.ids; put plan.outcome in the header and the response field ...
    store.record_soon(executor, plan, completion_ids, finish_reason, returned_assistant_message)  # or .record
"""

from token_proxy.sessions.codec import ChatCodec, TemplateCodec
from token_proxy.sessions.keys import SESSION_ID_FIELD, SESSION_ID_HEADER, session_key
from token_proxy.sessions.metrics import SessionCollector
from token_proxy.sessions.outcome import HEADER, RESPONSE_FIELD, Divergence, Fallback, SessionOutcome
from token_proxy.sessions.store import SessionPlan, SessionStats, SessionStore

__all__ = ["HEADER", "RESPONSE_FIELD", "SESSION_ID_FIELD", "SESSION_ID_HEADER", "ChatCodec", "Divergence",
           "Fallback", "SessionCollector", "SessionOutcome", "SessionPlan", "SessionStats", "SessionStore",
           "TemplateCodec", "session_key"]
