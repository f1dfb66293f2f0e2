"""The --workers LoRA map protocol (token_proxy/lora/sync.py), without processes: when may the
owner unload a replaced adapter version?"""

from __future__ import annotations

from token_proxy.lora import AdapterRegistry
from token_proxy.lora.registry import Adapter
from token_proxy.lora.sync import AdapterPublisher, apply_map


def owner() -> tuple[AdapterRegistry, AdapterPublisher, list[str]]:
    registry = AdapterRegistry(base_names={"base"})
    unloaded: list[str] = []
    registry.on_idle = lambda adapter: unloaded.append(adapter.internal)
    return registry, AdapterPublisher(registry), unloaded


def load(registry: AdapterRegistry, name: str, path: str) -> Adapter | None:
    """What LoraAdmin.load does with the registry; returns the adapter to unload at once, if any."""
    version, internal = registry.next_version(name)
    old = registry.switch(Adapter(name=name, path=path, internal=internal, version=version))
    return old if old is not None and not registry.in_use(old) else None


async def test_a_replaced_version_waits_for_every_worker_to_move_past_the_map_that_named_it():
    registry, publisher, unloaded = owner()
    load(registry, "policy", "/w/1")
    first = publisher.offer(0)  # worker 0 got the map naming policy@v1 (it may resolve to it now)
    assert first["version"] == 1 and [a["internal"] for a in first["adapters"]] == ["policy@v1"]
    publisher.report(0, seq=1, seen=1, held=[])
    assert load(registry, "policy", "/w/2") is None  # still pinned by worker 0's map
    assert unloaded == []
    publisher.offer(0)  # the new map (version 2) goes out...
    publisher.report(0, seq=2, seen=1, held=[])  # ...but worker 0 has not applied it yet
    assert unloaded == []
    publisher.report(0, seq=3, seen=2, held=[])  # applied, and nothing holds v1
    assert unloaded == ["policy@v1"]


async def test_requests_still_on_the_old_version_keep_it_and_a_late_report_is_ignored():
    registry, publisher, unloaded = owner()
    load(registry, "policy", "/w/1")
    publisher.offer(0)
    publisher.offer(1)
    load(registry, "policy", "/w/2")
    publisher.offer(0)
    publisher.offer(1)
    publisher.report(0, seq=5, seen=2, held=["policy@v1"])  # a stream on v1 still runs on worker 0
    publisher.report(1, seq=1, seen=2, held=[])
    assert unloaded == []
    publisher.report(0, seq=4, seen=2, held=[])  # an older report, arriving late: no effect
    assert unloaded == []
    publisher.report(0, seq=6, seen=2, held=[])
    assert unloaded == ["policy@v1"]
    assert [a.internal for a in registry.held()] == ["policy@v2"]


def test_a_worker_mirror_follows_the_map_and_keeps_what_its_requests_hold():
    mirror = AdapterRegistry(base_names={"base"})
    released: list[str] = []
    mirror.on_idle = lambda adapter: released.append(adapter.internal)
    v1 = {"name": "policy", "path": "/w/1", "internal": "policy@v1", "version": 1, "loaded_at": 1.0}
    apply_map(mirror, [v1])
    lease = mirror.lease("policy")
    assert lease.lora_path == "policy@v1"
    apply_map(mirror, [{**v1, "path": "/w/2", "internal": "policy@v2", "version": 2}])
    assert mirror.resolve("policy") == "policy@v2"
    assert [a.internal for a in mirror.held() if mirror.in_use(a)] == ["policy@v1"]  # what it reports
    lease.release()
    assert released == ["policy@v1"]  # the follower's cue to report at once
    apply_map(mirror, [])
    assert mirror.adapters() == []


async def test_a_change_is_published_once_every_live_worker_applied_it():
    """A load or unload answers after `published` (issue 31): every worker that polls applied the new map."""
    import asyncio

    registry, publisher, _ = owner()
    publisher.report(0, seq=1, seen=0, held=[])
    publisher.report(1, seq=1, seen=0, held=[])
    load(registry, "policy", "/w/1")  # map version 1
    waiting = asyncio.ensure_future(publisher.published(timeout_s=5.0))
    await asyncio.sleep(0.01)
    publisher.report(0, seq=2, seen=1, held=[])
    await asyncio.sleep(0.01)
    assert not waiting.done()  # worker 1 has not applied it yet
    publisher.report(1, seq=2, seen=1, held=[])
    assert await asyncio.wait_for(waiting, 1.0) is True
    load(registry, "policy", "/w/2")  # version 2: worker 1 never answers again
    publisher.report(0, seq=3, seen=2, held=[])
    assert await publisher.published(timeout_s=0.05) is False
