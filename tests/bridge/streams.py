"""The recorded streams (tests/bridge/fixtures/) as replay channels, for the decoder tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"


@dataclass
class Recording:
    doc: dict
    blob: bytes

    def broadcast_bytes(self, i: int) -> bytes:
        b = self.doc["broadcasts"][i]
        return self.blob[b["offset"]:b["offset"] + b["nbytes"]]

    def expected(self) -> list[tuple[str, str, tuple[int, ...], bytes]]:
        return [(t["name"], t["dtype"], tuple(t["shape"]), self.blob[t["offset"]:t["offset"] + t["nbytes"]])
                for t in self.doc["tensors"]]


def recording(stem: str) -> Recording:
    return Recording(json.loads((FIXTURES / f"{stem}.json").read_text()), (FIXTURES / f"{stem}.bin").read_bytes())


class ReplayChannel:
    """A receiving rank over a recording: each recv must ask for exactly the next broadcast's dtype and size
    (else the real stream would hang or tear); its buffer is that broadcast's bytes."""

    def __init__(self, rec: Recording):
        self.rec, self.next, self.posted = rec, 0, []

    def recv(self, dtype: str, numel: int) -> bytes:
        want = self.rec.doc["broadcasts"][self.next]
        self.posted.append([dtype, numel])
        assert (dtype, numel) == (want["dtype"], want["numel"]), f"broadcast {self.next}: posted {dtype}[{numel}]"
        self.next += 1
        return self.rec.broadcast_bytes(self.next - 1)

    def host_bytes(self, buffer: bytes) -> bytes:
        return buffer

    def finished(self) -> bool:
        return self.next == len(self.rec.doc["broadcasts"])
