"""The ctypes binding of torch's libnccl (bridge/libnccl.py), on CPU: which library it picks, the prototypes it sets
(nccl.h's, as vLLM 0.33's pynccl_wrapper declares them), its error messages, and — through a stand-in libnccl.so.2
compiled here from C with nccl.h's signatures — that the id goes by value, the communicator comes back through the
pointer, and the broadcast's pointers, count, type, root, communicator and stream arrive as given. No GPU and no
real NCCL: what this cannot show is NCCL itself (the lead's 2-GPU round does)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from token_proxy.bridge import libnccl
from token_proxy.bridge.libnccl import ENV_SO, Nccl, NcclError, UniqueId, find_library, wire_type


def test_the_override_wins(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 42  /opt/x/nvidia/nccl/lib/libnccl.so.2\n")
    assert find_library({ENV_SO: "/my/libnccl.so.2"}, str(maps), []) == ("/my/libnccl.so.2", ENV_SO)


def test_the_copy_torch_mapped_comes_next(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 rw-p 00000000 00:00 0 \n"
                    "7f10-7f20 r-xp 00000000 08:01 41  /opt/v/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so\n"
                    "7f20-7f30 r-xp 00000000 08:01 42  /opt/v/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2\n")
    wheel = tmp_path / "site" / "nvidia" / "nccl" / "lib"
    wheel.mkdir(parents=True)
    (wheel / "libnccl.so.2").write_bytes(b"")
    assert find_library({}, str(maps), [str(tmp_path / "site")]) == (
        "/opt/v/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2", "loaded in this process")


def test_then_the_nvidia_wheel_then_the_loader(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 rw-p 00000000 00:00 0 \n")
    wheel = tmp_path / "site" / "nvidia" / "nccl" / "lib"
    wheel.mkdir(parents=True)
    (wheel / "libnccl.so.2").write_bytes(b"")
    assert find_library({}, str(maps), [str(tmp_path / "empty"), str(tmp_path / "site")]) == (
        str(wheel / "libnccl.so.2"), "nvidia-nccl wheel")
    assert find_library({}, str(tmp_path / "no-maps"), [str(tmp_path / "empty")]) == ("libnccl.so.2",
                                                                                       "the dynamic loader")


def test_wire_types_are_pynccl_ones_and_bytes_otherwise():
    assert wire_type("bfloat16", 10, 2) == (9, 10)
    assert wire_type("float32", 3, 4) == (7, 3)
    assert wire_type("int64", 1, 8) == (4, 1)
    assert wire_type("uint8", 5, 1) == (1, 5)
    assert wire_type("float8_e4m3fn", 4, 1) == (10, 4)
    assert wire_type("bool", 6, 1) == (1, 6)
    assert wire_type("complex64", 2, 8) == (1, 16)


class _Fn:
    def __init__(self, name, result=0):
        self.name, self.result, self.calls = name, result, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.result


class _FakeLib:
    def __init__(self, missing=(), results=None):
        for name, *_ in libnccl.FUNCTIONS:
            if name not in missing:
                setattr(self, name, _Fn(name, (results or {}).get(name, 0)))
        if "ncclGetErrorString" not in missing:
            self.ncclGetErrorString.result = b"invalid usage (run with NCCL_DEBUG=WARN for details)"
        if "ncclGetLastError" not in missing:
            self.ncclGetLastError.result = b"ncclCommInitRank: rank 1 nranks 2"


def test_prototypes_are_nccl_h_ones():
    lib = _FakeLib()
    Nccl("/x/libnccl.so.2", cdll=lambda path: lib)
    vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    assert lib.ncclCommInitRank.argtypes[1:] == [i, UniqueId, i]
    assert lib.ncclCommInitRank.argtypes[0]._type_ is vp
    assert lib.ncclBroadcast.argtypes == [vp, vp, sz, i, i, vp, vp]
    assert lib.ncclAllReduce.argtypes == [vp, vp, sz, i, i, vp, vp]
    assert lib.ncclGetUniqueId.argtypes[0]._type_ is UniqueId
    assert (lib.ncclGetErrorString.restype, lib.ncclCommAbort.argtypes) == (ctypes.c_char_p, [vp])
    assert {lib.ncclBroadcast.restype, lib.ncclCommInitRank.restype, lib.ncclCommAbort.restype} == {i}
    assert ctypes.sizeof(UniqueId) == 128


def test_failed_calls_name_the_call_and_nccl_words():
    lib = _FakeLib(results={"ncclCommInitRank": 5})
    nccl = Nccl("/x/libnccl.so.2", cdll=lambda path: lib)
    with pytest.raises(NcclError) as err:
        nccl.init_rank(2, UniqueId(), 1)
    assert str(err.value) == ("ncclCommInitRank: NCCL error 5: invalid usage (run with NCCL_DEBUG=WARN for details) "
                              "(ncclCommInitRank: rank 1 nranks 2)")
    assert lib.ncclGetErrorString.calls == [(5,)]


def test_optional_symbols_may_be_missing_required_ones_may_not():
    lib = _FakeLib(missing=("ncclGetLastError",), results={"ncclBroadcast": 2})
    nccl = Nccl("/x/libnccl.so.2", cdll=lambda path: lib)
    with pytest.raises(NcclError, match=r"^ncclBroadcast: NCCL error 2: invalid usage"):
        nccl.broadcast(None, 1, 1, 7, 0, None, 0)
    with pytest.raises(NcclError) as err:
        Nccl("/x/libfoo.so", cdll=lambda path: _FakeLib(missing=("ncclCommInitRank",)))
    assert str(err.value) == f"/x/libfoo.so has no ncclCommInitRank: not an NCCL 2.x library; set {ENV_SO}"


def test_an_unloadable_library_names_the_override():
    def cdll(path):
        raise OSError(f"{path}: cannot open shared object file: No such file or directory")

    with pytest.raises(NcclError) as err:
        Nccl("/nope/libnccl.so.2", cdll=cdll)
    assert str(err.value) == ("could not load NCCL from /nope/libnccl.so.2 (given): /nope/libnccl.so.2: cannot open "
                              f"shared object file: No such file or directory; set {ENV_SO} to the libnccl.so.2 your "
                              "torch uses (site-packages/nvidia/nccl/lib/libnccl.so.2)")


def test_a_unique_id_is_128_bytes():
    raw = bytes(range(128))
    assert bytes(Nccl.unique_id_from(raw)) == raw
    with pytest.raises(NcclError, match="^an NCCL unique id is 128 bytes, got 127$"):
        Nccl.unique_id_from(raw[:127])


# A stand-in libnccl.so.2 with nccl.h's signatures: real ctypes marshalling through a real shared object.
SHIM = r"""
#include <stddef.h>
#include <string.h>
typedef struct { char internal[128]; } ncclUniqueId;
typedef void *ncclComm_t;
static char seen_uid[128]; static int seen[8]; static const void *seen_ptr[4]; static size_t seen_count;
static int comm_storage;
const char *ncclGetErrorString(int r) { return r == 3 ? "internal error" : "other"; }
int ncclGetVersion(int *v) { *v = 22809; return 0; }
int ncclGetUniqueId(ncclUniqueId *u) { for (int i = 0; i < 128; i++) u->internal[i] = (char)(255 - i); return 0; }
int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  memcpy(seen_uid, id.internal, 128); seen[0] = nranks; seen[1] = rank; *comm = &comm_storage; return 0; }
int ncclBroadcast(const void *s, void *r, size_t count, int dtype, int root, ncclComm_t comm, void *stream) {
  seen_ptr[0] = s; seen_ptr[1] = r; seen_ptr[2] = comm; seen_ptr[3] = stream; seen_count = count;
  seen[2] = dtype; seen[3] = root; return count == 0 ? 3 : 0; }
int ncclAllReduce(const void *s, void *r, size_t count, int dtype, int op, ncclComm_t comm, void *stream) {
  seen_count = count; seen[2] = dtype; seen[4] = op; seen_ptr[2] = comm; seen_ptr[3] = stream; return 0; }
int ncclCommDestroy(ncclComm_t c) { return 0; }
int ncclCommAbort(ncclComm_t c) { seen[5] = c == &comm_storage; return 0; }
const char *shim_uid(void) { return seen_uid; }
int shim_int(int i) { return seen[i]; }
const void *shim_ptr(int i) { return seen_ptr[i]; }
size_t shim_count(void) { return seen_count; }
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler for the stand-in libnccl")
    d = tmp_path_factory.mktemp("shim")
    (d / "nccl.c").write_text(SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(d / "libnccl.so.2"), str(d / "nccl.c")], check=True,
                   timeout=60)
    lib = ctypes.CDLL(str(d / "libnccl.so.2"))
    lib.shim_uid.restype, lib.shim_ptr.restype, lib.shim_count.restype = (ctypes.c_void_p, ctypes.c_void_p,
                                                                           ctypes.c_size_t)
    return str(d / "libnccl.so.2"), lib


def test_calls_reach_a_real_shared_object_as_nccl_h_says(shim):
    path, probe = shim
    nccl = Nccl(path)
    assert (nccl.version(), nccl.found_by) == ("2.28.9", "given")
    uid = nccl.unique_id()
    assert bytes(uid) == bytes(255 - i for i in range(128))
    comm = nccl.init_rank(3, Nccl.unique_id_from(bytes(range(128))), 2)
    assert ctypes.string_at(probe.shim_uid(), 128) == bytes(range(128))  # by value, all 128 bytes
    assert (probe.shim_int(0), probe.shim_int(1)) == (3, 2)
    assert comm.value is not None
    recv = ctypes.create_string_buffer(16)
    nccl.broadcast(None, ctypes.addressof(recv), (1 << 33) + 5, 9, 0, comm, 0x7F00_0000_1234)
    assert (probe.shim_ptr(0), probe.shim_ptr(1), probe.shim_ptr(2), probe.shim_ptr(3)) == (
        None, ctypes.addressof(recv), comm.value, 0x7F00_0000_1234)
    assert (probe.shim_count(), probe.shim_int(2), probe.shim_int(3)) == ((1 << 33) + 5, 9, 0)
    nccl.all_reduce(ctypes.addressof(recv), ctypes.addressof(recv), 1, 7, libnccl.SUM, comm, 0)
    assert (probe.shim_count(), probe.shim_int(2), probe.shim_int(4), probe.shim_ptr(3)) == (1, 7, 0, None)
    with pytest.raises(NcclError, match=r"^ncclBroadcast: NCCL error 3: internal error$"):
        nccl.broadcast(None, ctypes.addressof(recv), 0, 9, 0, comm, 0)
    nccl.abort(comm)
    assert probe.shim_int(5) == 1
