"""Trainer side of SGLang's NCCL weight sync: push a model's tensors into SGLang through the proxy.

    from token_proxy.broadcast import SGLangBroadcaster
    caster = SGLangBroadcaster("http://proxy:8000", master_address="10.0.0.1", master_port=29500,
                               inference_world_size=8)
    caster.init()
    caster.update(model.state_dict().items(), version="step-12")
    caster.close()

One proxy per inference node (README "Layouts"): pass every proxy, `SGLangBroadcaster(["http://node1:8000",
"http://node2:8000"], ..., inference_world_size=16)`; each call goes to all of them, and each proxy's ranks
start at 1 + i * inference_world_size / len(url) (prime-rl's rank_offset rule).

torch is an optional extra (`pip install sglang-token-proxy[broadcast]`).
"""

from token_proxy.broadcast.broadcaster import BroadcastError, SGLangBroadcaster

__all__ = ["BroadcastError", "SGLangBroadcaster"]
