"""`Job`: what the pipeline reads of any parsed inference request, whichever endpoint parsed it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from token_proxy.vocabulary import SamplingRequest


class ParsedRequest(Protocol):
    """The fields every endpoint's parsed request has (api/<endpoint>/request.py)."""

    model: str | None
    sampling: SamplingRequest
    request_id: str | None
    cache_salt: str | None
    priority: int | None


@dataclass(frozen=True, slots=True)
class Job:
    id_prefix: str  # of the response id and SGLang rid: "chatcmpl", "cmpl", "generate-tokens"
    model: str | None
    sampling: SamplingRequest
    stream: bool
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int | None = None

    @classmethod
    def of(cls, id_prefix: str, req: ParsedRequest, stream: bool) -> Job:
        """The one constructor the endpoints share: the request's own fields, its parsed sampling."""
        return cls(id_prefix, req.model, req.sampling, stream, req.request_id, req.cache_salt, req.priority)
