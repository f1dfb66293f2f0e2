"""sglang/fleet_view.py: one live view of the fleet. Connecting, the admin fan-out and the fence list the workers
through it; its snapshot is the picture the data path reads; the admin plane keeps no list or facts of its own."""

from __future__ import annotations

import orjson

from token_proxy.admin import ADMIN
from token_proxy.fleet import AdminPlane
from token_proxy.settings import Settings
from token_proxy.sglang import Workers
from token_proxy.sglang.discovery import CONNECTION
from token_proxy.sglang.fleet_view import FleetView
from token_proxy.sglang.picture import BackendInfo, picture_of

ROUTER, A, B, C = "http://router:1", "http://a:1", "http://b:1", "http://c:1"


class Router:
    """An sglang-router stand-in: GET /workers answers `listing` (None: a 404, as a plain SGLang answers);
    every other call answers 200 {"success": true}. Every call is recorded as (url, path)."""

    def __init__(self, base_url: str, calls: list, listing: list):
        self.base_url, self.calls, self.listing = base_url, calls, listing

    def at(self, url: str) -> Router:
        return Router(url, self.calls, self.listing)

    async def call(self, method, path, raw, timeout_s):
        self.calls.append((self.base_url, path))
        if path == "/workers":
            if self.listing[0] is None:
                return 404, b'{"detail": "Not Found"}', "application/json"
            return 200, orjson.dumps({"workers": [{"url": url, "id": url[-3:]} for url in self.listing[0]]}), ""
        return 200, b'{"success": true}', "application/json"


def info(name: str) -> BackendInfo:
    return BackendInfo(name, name, 4096, True)


async def test_the_fan_out_lists_the_workers_through_the_view_and_the_plane_reads_the_same_list():
    calls: list = []
    listing: list = [[A, B]]
    router = Router(ROUTER, calls, listing)
    view = FleetView(Settings(backend_url=ROUTER), router)
    assert await view.list_workers(always_ask=True) == [A, B]  # what connecting does
    view.learned(picture_of(ROUTER, {A: info("a"), B: info("b")}))
    plane = AdminPlane(settings=view.settings, workers=Workers(view.settings, router, view=view), version_keys={})
    assert plane.workers.view is view and plane.workers.last_urls == (A, B)  # the list connecting read

    listing[0] = [A, C]  # the router gained C; the fence took B out of its list (B is still reached)
    plane.fenced.router_removed[B] = None
    replies = await plane.fan_out("POST", "/flush_cache", None, 5.0)
    assert [r.url for r in replies] == [A, C, B]
    assert view.urls == (A, C) and plane.fleet_urls() == [A, C, B] and plane.workers.behind_router is True

    # Facts: the last connect's, by url (a trailing slash is the same worker); C was listed since: unknown.
    assert (plane.facts(A + "/"), plane.facts(C)) == (info("a"), None)
    assert view.snapshot().worker_urls == [A, B]


async def test_the_fan_outs_first_answer_says_whether_the_backend_is_a_router_and_connecting_leaves_it():
    calls: list = []
    listing: list = [[]]
    view = FleetView(Settings(backend_url=ROUTER), Router(ROUTER, calls, listing))
    assert await view.list_workers(always_ask=True) is None  # connecting: a router that lists no worker yet
    assert (view.urls, view.behind_router) == ((ROUTER,), None)  # what a fan-out would reach; no verdict
    listing[0] = None  # a plain SGLang answers 404
    assert await view.list_workers() == [ROUTER] and view.behind_router is False
    assert await view.list_workers() == [ROUTER]
    assert calls == [(ROUTER, "/workers")] * 2  # known to be no router: the fan-out asks no more
    listing[0] = [A]
    assert await view.list_workers(always_ask=True) == [A] and view.behind_router is False  # connecting asks
    assert len(calls) == 3 and view.urls == (A,)


async def test_worker_flags_are_the_list_and_no_router_is_asked():
    calls: list = []
    view = FleetView(Settings(backend_url=ROUTER, workers=(A + "/", B)), Router(ROUTER, calls, [[C]]))
    assert await view.list_workers(always_ask=True) == [A, B] and view.urls == (A, B) and calls == []


async def test_the_data_paths_picture_is_the_views_snapshot_and_the_admin_plane_holds_the_same_view(
        make_sim, make_proxy):
    sim = await make_sim()
    proxy = await make_proxy(sim)
    url = str(sim.make_url("")).rstrip("/")
    conn = proxy.app[CONNECTION]
    assert conn.view.snapshot() is conn.connected.picture and conn.view.urls == (url,)
    plane = proxy.app[ADMIN]
    assert plane.workers.view is conn.view
    assert await plane.worker_urls() == [url] and conn.view.behind_router is False  # a plain SGLang: /workers 404
    assert plane.facts(url) is conn.connected.picture.workers[url]
