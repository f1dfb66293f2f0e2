"""The weight bridge: a relay on each inference node that joins a trainer's own NCCL group as vLLM's receiver
does, decodes the trainer's stream (prime-rl's in-band dialect, or vLLM 0.33's packed / unpacked transfer), and
hands each bucket to SGLang over CUDA IPC (`/update_weights_from_tensor`).

Pure modules (no torch): `wire` (the two dialects' framing), `unpickle` (the allowlisted unpicklers), `layout`
(which receiving rank serves which SGLang GPU). torch is imported lazily by `nccl`, `handoff`, `receiver` and the
entry point (`python -m token_proxy.bridge`, the `[bridge]` extra); the proxy never imports this package.
"""
