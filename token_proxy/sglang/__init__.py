"""Everything about SGLang itself: the frozen picture discovery learns (picture.py, discovery.py,
versions.py), the client and its one retry point (client.py, retry_rules.py), the stream reader
(relay.py, http1.py, events.py, deadline.py) and what SGLang's replies mean (replies.py), the /generate
body (payload.py, sampling.py), requests in flight (in_flight.py), pause modes (pause.py) and the
admin fan-out to every worker (workers.py)."""

from token_proxy.faces import door

__all__ = [
    "WORKERS",
    "SGLangClient",
    "SGLangFeatures",
    "SGLangPicture",
    "WorkerReply",
    "Workers",
    "sglang_request",
]

__getattr__ = door(__name__, {
    "WORKERS": "workers",
    "SGLangClient": "client",
    "SGLangFeatures": "versions",
    "SGLangPicture": "picture",
    "WorkerReply": "workers",
    "Workers": "workers",
    "sglang_request": "payload",
})
