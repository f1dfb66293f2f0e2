"""Read-only views of the simulated server: /model_info, /server_info, /v1/models, /get_load (/metrics: metrics.py)."""

from __future__ import annotations

import time

from token_proxy.simulator.state import SimState

# The real value depends on GPU memory; the golden H200 server reported this.
MAX_TOTAL_NUM_TOKENS = 174777523


def model_info(sim: SimState) -> dict:
    config = sim.config
    return {
        # SGLang's tokenizer manager sets model_path to the last checkpoint loaded from disk (an NCCL push
        # leaves it): update_weights_from_disk's `self.model_path = obj.model_path`.
        "model_path": sim.loaded_from or config.model_path,
        "tokenizer_path": config.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": sim.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "embedding": {"family": "none", "task": "none", "enabled": False},
    }


def server_info(sim: SimState, host: str, port: int) -> dict:
    """The server-args keys a client reads (the real reply has ~460), then the runtime extras."""
    args = _server_args(sim, host, port)
    return {
        **args,
        "status": "ready",
        "max_total_num_tokens": MAX_TOTAL_NUM_TOKENS,
        "page_size": 1,
        "max_req_input_len": sim.config.max_req_input_len,
        "startup_time": {"load_weight": 0.0, "kv_cache_allocation": 0.0},
        "internal_states": [
            {
                **args,
                "last_gen_throughput": 0.0,
                "effective_max_running_requests_per_dp": sim.config.max_running_requests or 4096,
            }
        ],
        "version": sim.config.sglang_version,
    }


def _server_args(sim: SimState, host: str, port: int) -> dict:
    config = sim.config
    return {
        "model_path": config.model_path,
        "tokenizer_path": config.tokenizer_path,
        "skip_tokenizer_init": False,
        "context_length": config.context_length,
        "is_embedding": False,
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": 1,
        "max_running_requests": config.max_running_requests,
        "host": host,
        "port": port,
        "served_model_name": config.model_name,
        "weight_version": sim.weight_version,
        "stream_interval": 1,
        "incremental_streaming_output": config.incremental_streaming_output,
        "enable_deterministic_inference": config.enable_deterministic_inference,
        "enable_memory_saver": config.enable_memory_saver,
        "enable_weights_cpu_backup": config.enable_weights_cpu_backup,
        "enable_metrics": True,
        "allow_auto_truncate": False,
        "enable_lora": config.enable_lora,
        "max_lora_rank": config.max_lora_rank,
        "lora_target_modules": list(config.lora_target_modules) if config.lora_target_modules else None,
        "max_loras_per_batch": 8,
    }


def models_list(sim: SimState) -> dict:
    name = sim.config.model_name
    card = {
        "id": name,
        "object": "model",
        "created": int(sim.started_at),
        "owned_by": "sglang",
        "root": name,
        "parent": None,
        "max_model_len": sim.config.context_length,
    }
    adapters = sim.lora.cards(name, int(sim.started_at)) if sim.config.enable_lora else []
    return {"object": "list", "data": [card, *adapters]}


def queued(sim: SimState) -> tuple[list, list]:
    """(running, waiting) as SGLang's scheduler holds them. A retract pause (Scheduler.pause_generation,
    0.5.17) empties the running batch: every unfinished request goes back to the waiting queue and its KV
    is freed, so a client waiting for zero running requests sees zero. An in-place pause keeps them."""
    if sim.paused and sim.pause_mode == "retract":
        return [], list(sim.running.values())
    started = [s for s in sim.running.values() if s.started]
    return started, [s for s in sim.running.values() if not s.started]


def loads(sim: SimState) -> dict:
    """/v1/loads?include=core (every version; /get_load was its shim until 0.5.21). As the scheduler's
    load_inquirer: num_used_tokens are the running requests' tokens in the KV cache, num_total_tokens add
    the waiting requests' prompts."""
    running, waiting = queued(sim)
    used = sum(len(s.spec.prompt) + len(s.output_ids) for s in running)
    total = used + sum(len(s.spec.prompt) for s in waiting)
    core = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": len(running),
            "num_waiting_reqs": len(waiting), "num_waiting_uncached_tokens": 0, "num_used_tokens": used,
            "num_total_tokens": total, "num_active_tokens": total,
            "num_prealloc_ready_tokens": 0, "max_total_num_tokens": MAX_TOTAL_NUM_TOKENS,
            "max_running_requests": sim.config.max_running_requests or 4096, "token_usage": 0.0,
            "gen_throughput": 0.0, "cache_hit_rate": 0.0, "utilization": 0.0}
    return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "version": sim.config.sglang_version, "accelerator": "cuda", "num_accelerators": 1, "loads": [core]}


def load(sim: SimState) -> list[dict]:
    """/get_load (until 0.5.20): 0.5.17's shim over /v1/loads, one item per dp rank."""
    return [get_load_item(core, time.perf_counter()) for core in loads(sim)["loads"]]


def get_load_item(core: dict, ts_tic: float) -> dict:
    """SGLang 0.5.17 http_server.get_load: a /v1/loads core entry in /get_load's historical shape."""
    return {
        "dp_rank": core["dp_rank"],
        "num_reqs": core["num_running_reqs"] + core["num_waiting_reqs"],
        "num_waiting_reqs": core["num_waiting_reqs"],
        "num_tokens": core["num_total_tokens"],
        "num_pending_tokens": core["num_total_tokens"] - core["num_used_tokens"],
        "ts_tic": ts_tic,
    }
