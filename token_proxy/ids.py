"""The one rule for ids a client chooses (a request id, a session id): at most MAX_ID_CHARS characters.

A request id becomes SGLang's rid and the X-Request-Id response header, so control characters would break
the response; a session id is a key of the session store. Low in the tree (just above errors.py) so the
body readers (api/fields.py), the header reader (pipeline/request_state.py), the pure session keys
(sessions/keys.py) and the OpenAPI description (ops/openapi.py) all read this one copy.
"""

from __future__ import annotations

import re

from token_proxy.errors import InvalidRequest

MAX_ID_CHARS = 256
CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f]")


def checked_id(value: str, param: str) -> str:
    """A client's id sent back as a header: at most MAX_ID_CHARS characters, none of them control ones."""
    if len(value) > MAX_ID_CHARS or CONTROL_CHARS.search(value):
        raise InvalidRequest(f"{param}: must be at most {MAX_ID_CHARS} characters, none of them control characters",
                             param=param)
    return value
