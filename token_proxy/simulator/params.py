"""The simulated model's named parameters, and the torch.distributed side of a weight-update group.

A handful of small tensors stand in for a Qwen2 checkpoint, so an NCCL-style push (names, dtypes,
shapes, then one broadcast per tensor from rank 0) can be received and checked for real. torch is
imported only when a group is joined: the simulator runs without it.
"""

from __future__ import annotations

import hashlib

# name -> shape; SGLang serves the tiny golden model in bfloat16.
PARAM_SHAPES: dict[str, tuple[int, ...]] = {
    "model.embed_tokens.weight": (32, 8),
    "model.layers.0.self_attn.q_proj.weight": (8, 8),
    "model.layers.0.mlp.down_proj.weight": (8, 16),
    "model.norm.weight": (8,),
    "lm_head.weight": (32, 8),
}


def initial_values(shape: tuple[int, ...], salt: int = 0) -> list:
    """Deterministic values exact in bfloat16 (multiples of 1/16 in [-0.5, 0.5])."""
    count = 1
    for dim in shape:
        count *= dim
    flat = [(((i + salt) * 37) % 17 - 8) / 16 for i in range(count)]
    return _nest(flat, shape)


def _nest(flat: list, shape: tuple[int, ...]) -> list:
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0]
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def initial_params() -> dict[str, list]:
    return {name: initial_values(shape, salt) for salt, (name, shape) in enumerate(PARAM_SHAPES.items())}


def as_list(value, truncate: int) -> list:
    """What /get_weights_by_name answers: the first `truncate` rows, as floats."""
    if hasattr(value, "float"):  # a received torch tensor
        return value[:truncate].float().tolist()
    return value[:truncate]


def digest(tensors: list) -> str:
    """A short fingerprint of received weights; it feeds the fake model, so outputs change."""
    hasher = hashlib.blake2b(digest_size=8)
    for tensor in tensors:
        hasher.update(tensor.float().numpy().tobytes())
    return hasher.hexdigest()


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float):
    """SGLang's init_custom_process_group (blocking; run it in a thread)."""
    from token_proxy.broadcast.group import join_group as join

    if not 0 <= master_port <= 65535:
        raise ValueError("Port out of range 0-65535")  # torch's words, which SGLang passes on
    return join(master_address, master_port, rank, world_size, group_name, backend, timeout_s)


def receive(group, dtypes: list[str], shapes: list[list[int]]) -> list:
    """One broadcast from rank 0 per announced tensor, in order (blocking; run it in a thread)."""
    import torch
    import torch.distributed as dist

    tensors = [torch.empty(shape, dtype=getattr(torch, str(dtype).removeprefix("torch."))) for dtype, shape
               in zip(dtypes, shapes)]
    handles = [dist.broadcast(tensor, src=0, group=group, async_op=True) for tensor in tensors]
    for handle in handles:
        handle.wait()
    return tensors


def leave_group(group) -> None:
    from token_proxy.broadcast.group import leave_group as leave

    leave(group)
