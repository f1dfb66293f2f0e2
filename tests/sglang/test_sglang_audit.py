"""bench/sglang_audit.py's extraction and diff, on small inline sources (offline: no wheel, no sglang)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("sglang_audit", Path(__file__).parents[2] / "bench" / "sglang_audit.py")
audit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(audit)

HTTP_OLD = '''
@app.get("/get_load")
async def get_load():
    return []

@app.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache():
    pass

@app.post("/update_weights_from_distributed")
@auth_level(AuthLevel.ADMIN_OPTIONAL)
async def update_weights_from_distributed(obj: Annotated[UpdateReq, Body()], request: Request):
    pass
'''
HTTP_NEW = HTTP_OLD.replace('@app.get("/get_load")', '@app.post("/begin_weight_update")').replace(
    "async def get_load():", "async def begin(obj: BeginReq):")
IO_OLD = '''
@dataclass
class BaseReq(ABC):
    rid: Optional[str] = None

@dataclass
class UpdateReq(BaseReq):
    names: List[str]
    flush_cache: bool = True
    disable_draft_model: bool = False
    KIND: ClassVar[str] = "x"
'''
IO_NEW = '''
class BaseReq(msgspec.Struct, kw_only=True):
    rid: Optional[str] = None

class UpdateReq(BaseReq, kw_only=True):
    names: List[str]
    flush_cache: bool = False
    selector: Literal["target", "draft", "all"] = "all"

class BeginReq(BaseReq, kw_only=True):
    selector: str = "all"
'''
UPDATER = '''
class Manager:
    def update(self, req):
        if self._session is None:
            return UpdateOutput(success=False, message="update must run between " "begin() and end()")
        assert req.group in self.groups, f"Group {req.group} not in the groups."
        if req.bad:
            raise ValueError(f"bad request: {req.bad}")
        def inner():
            return Out(success=False, message="nested, counted once")
        return UpdateOutput(success=True, message="ok")
'''
SAMPLING_OLD = '''
class SamplingParams:
    def __init__(self, max_new_tokens: int = 128, stop=None, *, n: int = 1):
        pass
'''
SAMPLING_NEW = '''
class SamplingParams(msgspec.Struct, kw_only=True):
    max_new_tokens: int = 128
    stop: Optional[str] = None
    beam_width: Optional[int] = None
'''


def test_routes_read_every_decorator_form_and_the_request_class():
    assert audit.routes(HTTP_OLD) == [
        {"method": "GET", "path": "/flush_cache", "handler": "flush_cache", "params": []},
        {"method": "POST", "path": "/flush_cache", "handler": "flush_cache", "params": []},
        {"method": "GET", "path": "/get_load", "handler": "get_load", "params": []},
        {"method": "POST", "path": "/update_weights_from_distributed", "handler": "update_weights_from_distributed",
         "params": ["Annotated", "Body", "Request", "UpdateReq"]},
    ]


def test_request_fields_follow_bases_skip_classvars_and_read_dataclasses_and_structs_alike():
    old = audit.request_classes(IO_OLD)
    assert audit.fields_of(old, "UpdateReq") == {
        "rid": {"type": "Optional[str]", "default": "None"},
        "names": {"type": "List[str]", "default": None},
        "flush_cache": {"type": "bool", "default": "True"},
        "disable_draft_model": {"type": "bool", "default": "False"},
    }
    new = audit.request_classes(IO_NEW)
    assert list(audit.fields_of(new, "UpdateReq")) == ["rid", "names", "flush_cache", "selector"]
    assert audit.fields_of(new, "Missing") == {}


def test_refusals_are_replies_raises_and_asserts_with_their_words():
    assert audit.refusals(UPDATER) == [
        {"function": "update", "kind": "reply", "text": "update must run between begin() and end()"},
        {"function": "update", "kind": "assert", "text": "Group {req.group} not in the groups."},
        {"function": "update", "kind": "raise", "text": "ValueError: bad request: {req.bad}"},
        {"function": "inner", "kind": "reply", "text": "nested, counted once"},
    ]


def test_sampling_keys_from_an_init_or_a_struct():
    assert audit.sampling_keys(SAMPLING_OLD) == {"max_new_tokens": "128", "stop": "None", "n": "1"}
    assert audit.sampling_keys(SAMPLING_NEW) == {"max_new_tokens": "128", "stop": "None", "beam_width": "None"}


def test_one_release_to_the_next_diff():
    files = {audit.HTTP_SERVER: HTTP_OLD, audit.IO_STRUCT: IO_OLD, audit.SAMPLING: SAMPLING_OLD,
             audit.REFUSAL_FILES[0]: UPDATER}
    before = audit.audit_sources(files)
    after = audit.audit_sources({**files, audit.HTTP_SERVER: HTTP_NEW, audit.IO_STRUCT: IO_NEW,
                                 audit.SAMPLING: SAMPLING_NEW,
                                 audit.REFUSAL_FILES[0]: UPDATER.replace("nested, counted once", "nested")})
    change = audit.diff(before, after)
    assert [(r["method"], r["path"], r["request"], r["proxy"]) for r in change["routes_added"]] == [
        ("POST", "/begin_weight_update", "BeginReq", True)]
    assert [(r["method"], r["path"]) for r in change["routes_removed"]] == [("GET", "/get_load")]
    assert change["requests_changed"] == {"UpdateReq": {
        "added": {"selector": {"type": "Literal['target', 'draft', 'all']", "default": "'all'"}},
        "removed": ["disable_draft_model"],
        "changed": {"flush_cache": {"before": {"type": "bool", "default": "True"},
                                    "after": {"type": "bool", "default": "False"}}}}}
    assert (change["sampling_params_added"], change["sampling_params_removed"]) == ({"beam_width": "None"}, ["n"])
    assert change["refusals_added"] == [{"file": audit.REFUSAL_FILES[0], "kind": "reply", "text": "nested"}]
    assert change["refusals_removed"] == [{"file": audit.REFUSAL_FILES[0], "kind": "reply",
                                           "text": "nested, counted once"}]
    page = audit.markdown({"0.1.0": before, "0.1.1": after}, {"0.1.1": change})
    assert "| 0.1.1 | 4 | `POST /begin_weight_update` | `GET /get_load` | UpdateReq | beam_width / n |" in page
    assert "**Routes added:** `POST /begin_weight_update` (**proxy**) (BeginReq)" in page
