"""SGLang's request dataclasses' defaults, per release, for the routes the simulator reads a body on: what a
field a client leaves out means (SGLang's FastAPI turns a missing field into the dataclass default).

Drawn from the audit (bench/sglang_versions.json, `releases[v].requests`); fields whose default is None are
left out (absent and None read the same). tests/simulator/test_request_defaults.py rebuilds this table from the
audit and asserts it is equal, per version, so the simulator cannot drift from SGLang again (it once read a
missing `abort_all_requests` on /update_weight_version as false, where every release defaults it to true).
"""

from __future__ import annotations

from token_proxy.simulator.config import VERSIONS

WEIGHT_GROUP = {"group_name": "weight_update_group"}

# path -> ((first release, request dataclass, its non-None defaults), ...): a row holds until the next one.
TABLE: dict[str, tuple[tuple[str, str, dict], ...]] = {
    "/abort_request": (("0.5.17", "AbortReq", {"abort_all": False}),),
    "/begin_weight_update": (("0.5.21", "BeginWeightUpdateReqInput", {"selector": "all"}),),
    "/continue_generation": (("0.5.17", "ContinueGenerationReqInput", {"torch_empty_cache": True}),),
    "/destroy_weights_update_group": (("0.5.17", "DestroyWeightsUpdateGroupReqInput", WEIGHT_GROUP),),
    "/end_weight_update": (("0.5.21", "EndWeightUpdateReqInput", {}),),
    "/get_weights_by_name": (("0.5.17", "GetWeightsByNameReqInput", {"truncate_size": 100}),),
    "/init_weights_update_group": (("0.5.17", "InitWeightsUpdateGroupReqInput", {**WEIGHT_GROUP, "backend": "nccl"}),),
    "/load_lora_adapter": (("0.5.17", "LoadLoRAAdapterReqInput", {"pinned": False}),),
    "/pause_generation": (("0.5.17", "PauseGenerationReqInput", {"mode": "abort"}),),
    "/release_memory_occupation": (("0.5.17", "ReleaseMemoryOccupationReqInput", {}),),
    "/resume_memory_occupation": (("0.5.17", "ResumeMemoryOccupationReqInput", {}),),
    "/unload_lora_adapter": (("0.5.17", "UnloadLoRAAdapterReqInput", {}),),
    "/update_weight_version": (("0.5.17", "UpdateWeightVersionReqInput", {"abort_all_requests": True}),),
    "/update_weights_from_disk": (("0.5.17", "UpdateWeightFromDiskReqInput", {
        "abort_all_requests": False, "is_async": False, "torch_empty_cache": False, "keep_pause": False,
        "recapture_cuda_graph": False, "token_step": 0, "flush_cache": True}),),
    "/update_weights_from_distributed": (
        ("0.5.17", "UpdateWeightsFromDistributedReqInput", {
            **WEIGHT_GROUP, "flush_cache": True, "abort_all_requests": False, "torch_empty_cache": False}),
        ("0.5.21", "UpdateWeightsFromDistributedReqInput", {
            **WEIGHT_GROUP, "flush_cache": True, "abort_all_requests": False, "selector": "all",
            "torch_empty_cache": False}),
    ),
    "/weights_checker": (
        ("0.5.17", "CheckWeightsReqInput", {"action": "checksum", "allow_quant_error": False}),
        ("0.5.21", "CheckWeightsReqInput", {"action": "checksum", "allow_quant_error": False, "selector": "all"}),
    ),
}


def request_class(version: str, path: str) -> tuple[str, dict] | None:
    """(the request dataclass, its non-None defaults) of `path` in release `version`; None if not tabled."""
    found = None
    for since, name, defaults in TABLE.get(path, ()):
        if VERSIONS.index(since) <= VERSIONS.index(version):
            found = (name, defaults)
    return found


def with_defaults(version: str, path: str, body: dict) -> dict:
    """`body` with every field it leaves out set to SGLang's default for that release."""
    found = request_class(version, path)
    return {**found[1], **body} if found else body
