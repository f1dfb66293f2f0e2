"""Trainer side of SGLang's NCCL weight sync: push a model's tensors into SGLang through the proxy.

    from token_proxy.broadcast import SGLangBroadcaster
    caster = SGLangBroadcaster("http://proxy:8000", master_address="10.0.0.1", master_port=29500,
                               inference_world_size=8)
    caster.init()
    caster.update(model.state_dict().items(), version="step-12")
    caster.close()

torch is an optional extra (`pip install sglang-token-proxy[broadcast]`).
"""

from token_proxy.broadcast.broadcaster import BroadcastError, SGLangBroadcaster

__all__ = ["BroadcastError", "SGLangBroadcaster"]
