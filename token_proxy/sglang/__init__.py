"""Everything about SGLang itself: the frozen picture discovery learns (picture.py, discovery.py,
versions.py), the client and its one retry point (client.py, retry_rules.py), the stream reader
(relay.py, http1.py, events.py, deadline.py) and what SGLang's replies mean (replies.py), the /generate
body (payload.py, sampling.py), requests in flight (in_flight.py), pause modes (pause.py), the fleet's one
live view (fleet_view.py: the worker list and the picture) and the admin fan-out to every worker (workers.py)."""

from token_proxy.sglang.client import SGLangClient
from token_proxy.sglang.payload import sglang_request
from token_proxy.sglang.picture import SGLangPicture
from token_proxy.sglang.versions import SGLangFeatures
from token_proxy.sglang.workers import WORKERS, WorkerReply, Workers

__all__ = [
    "WORKERS",
    "SGLangClient",
    "SGLangFeatures",
    "SGLangPicture",
    "WorkerReply",
    "Workers",
    "sglang_request",
]
