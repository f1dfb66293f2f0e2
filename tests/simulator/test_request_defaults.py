"""The simulator's request defaults are SGLang's: every simulated route that reads a body fills what a client
leaves out from its request dataclass's defaults as bench/sglang_versions.json (the audit of each released
wheel) records them, per version, so the two cannot drift (the simulator once read a missing
`abort_all_requests` on /update_weight_version as false; every release defaults it to true)."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

import pytest

from tests.support.admin_fixtures import until
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.config import VERSIONS
from token_proxy.simulator.request_defaults import TABLE, request_class

AUDIT = json.loads((Path(__file__).parents[2] / "bench" / "sglang_versions.json").read_text())["releases"]
# Routes whose bodies the simulator parses by their own rules (generate_request.py), not through the admin
# `_body` that fills the defaults.
OWN_PARSERS = {"GenerateReqInput"}


def audited_class(version: str, path: str) -> str | None:
    """The request dataclass of POST `path` in the audit of `version`."""
    classes = {r["request"] for r in AUDIT[version]["routes"] if r["path"] == path and r["method"] == "POST"}
    (name,) = classes or {None}
    return name


def audited(version: str, path: str) -> tuple[str, dict] | None:
    """(request dataclass, its non-None defaults) of POST `path` in the audit of `version`."""
    name = audited_class(version, path)
    if name is None:
        return None
    fields = AUDIT[version]["requests"][name]
    defaults = {field: ast.literal_eval(f["default"]) for field, f in fields.items() if f["default"] is not None}
    return name, {field: value for field, value in defaults.items() if value is not None}


def test_the_audit_covers_every_version_the_simulator_speaks():
    assert tuple(AUDIT) == VERSIONS


@pytest.mark.parametrize("version", VERSIONS)
def test_every_tabled_route_has_the_audits_dataclass_and_defaults(version):
    for path in TABLE:
        assert request_class(version, path) == audited(version, path), (version, path)


@pytest.mark.parametrize("version", VERSIONS)
async def test_every_simulated_route_with_a_request_dataclass_is_tabled(make_sim, version):
    """A new simulated admin route must come with its defaults: its dataclass in the audit names it."""
    sim = await make_sim(sglang_version=version)
    served = {route.resource.canonical for route in sim.app.router.routes() if route.method == "POST"}
    untabled = sorted(path for path in served if path not in TABLE and audited_class(version, path)
                      not in (None, *OWN_PARSERS))
    assert untabled == []


async def test_update_weight_version_without_the_field_aborts_every_request_as_sglang_does(make_sim):
    import aiohttp

    sim = await make_sim(tpot_s=0.01)
    url = str(sim.make_url("")).rstrip("/")
    async with aiohttp.ClientSession(url) as http:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        async def generate():
            return await (await http.post("/generate", json=body)).json()

        rollout = asyncio.create_task(generate())
        await until(lambda: sim.app[SIM_STATE].running)
        reply = await http.post("/update_weight_version", json={"new_version": "2"})
        assert (reply.status, await reply.json()) == (200, {"success": True, "message": "Weight version updated to 2",
                                                            "new_version": "2"})
        out = await asyncio.wait_for(rollout, 10)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 200
