"""The allowlisted unpicklers: the NCCL unique id in both encodings found in the wild, prime-rl's metadata, and
refusals of anything else."""

from __future__ import annotations

import os
import pickle

import pytest

from tests.bridge.streams import FIXTURES
from token_proxy.bridge.unpickle import RefusedPickle, read_primerl_metadata, read_unique_id

UID = bytes(range(64)) + bytes(range(0xC0, 0x100))  # what record_streams.py put in the id


def test_unique_id_from_vllms_ctypes_struct():
    uid = read_unique_id((FIXTURES / "uid_vllm_ctypes.pkl").read_bytes())
    assert (uid.raw, uid.encoding) == (UID, "vllm-ctypes")


def test_unique_id_from_raw_bytes():
    uid = read_unique_id((FIXTURES / "uid_raw_bytes.pkl").read_bytes())
    assert (uid.raw, uid.encoding) == (UID, "raw-bytes")


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize(("payload", "message"), [
    (pickle.dumps(_Evil()), "refused to unpickle posix.system"),
    (pickle.dumps(b"short"), "must be 128 bytes; the store held 5 bytes"),
    (pickle.dumps("x" * 128), "must be 128 bytes; the store held str"),
    (b"\x80\x04garbage", "not a readable pickle"),
])
def test_unique_id_refusals(payload, message):
    with pytest.raises(RefusedPickle, match=message):
        read_unique_id(payload)


def test_a_ctypes_pickle_of_another_class_is_refused():
    good = (FIXTURES / "uid_vllm_ctypes.pkl").read_bytes()
    other = good.replace(b"ncclUniqueId", b"ncclUniqueIx")
    with pytest.raises(RefusedPickle, match="pynccl_wrapper.ncclUniqueIx"):
        read_unique_id(other)


def test_primerl_metadata_refuses_other_globals():
    with pytest.raises(RefusedPickle, match="refused to unpickle posix.system"):
        read_primerl_metadata(pickle.dumps({"k": _Evil()}))
    with pytest.raises(RefusedPickle, match="is not \\(name, shape, numel\\)"):
        read_primerl_metadata(_bad_numel())


def _bad_numel() -> bytes:
    """prime-rl's shape of metadata with numel not the shape's product (built without torch: the same opcodes)."""
    good = _primerl_pickle()
    assert good.count(b"M\x00\x04") == 2  # numel 1024 (BININT2): the embedding's and lm_head's
    return good.replace(b"M\x00\x04", b"M\x01\x04", 1)


def _primerl_pickle() -> bytes:
    """The first metadata pickle of the recorded prime-rl stream."""
    from tests.bridge.streams import recording

    return recording("primerl").broadcast_bytes(2)


def test_primerl_metadata_reads_dtypes_and_sizes_without_torch():
    groups = read_primerl_metadata(_primerl_pickle())
    assert [(d, [e[0] for e in entries]) for d, entries in groups] == [
        ("bfloat16", ["model.embed_tokens.weight", "lm_head.weight"]), ("float32", ["model.norm.weight"])]
    assert groups[0][1][0] == ("model.embed_tokens.weight", (64, 16), 1024)
