"""The bridge's one conversation with SGLang: what it serves (`/server_info`, `/model_info`) and one bucket's load
(`/update_weights_from_tensor`, one payload per TP rank). The session bracket, the version and the flush are the
proxy's (its fleet rules), not the bridge's."""

from __future__ import annotations

import aiohttp

from token_proxy.bridge.layout import Gpu


async def worker_gpus(session: aiohttp.ClientSession, url: str) -> list[Gpu]:
    """SGLang's TP ranks and their GPUs: `base_gpu_id + tp_rank * gpu_id_step` (SGLang's own placement)."""
    async with session.get(f"{url}/server_info") as r:
        r.raise_for_status()
        info = await r.json()
    tp, dp = int(info.get("tp_size") or 1), int(info.get("dp_size") or 1)
    if dp != 1:
        raise ValueError(f"{url}: dp_size {dp}: the bridge serves one data-parallel replica per worker")
    base, step = int(info.get("base_gpu_id") or 0), int(info.get("gpu_id_step") or 1)
    return [Gpu(url, rank, base + rank * step) for rank in range(tp)]


async def model_path(session: aiohttp.ClientSession, url: str) -> str:
    """The checkpoint SGLang serves (`/model_info`'s model_path: a local directory, or a hub id); "" if unsaid."""
    async with session.get(f"{url}/model_info") as r:
        if r.status != 200:
            return ""
        return str((await r.json()).get("model_path") or "")


async def load_bucket(session: aiohttp.ClientSession, url: str, payloads: list[str], timeout_s: float,
                      ) -> tuple[bool, str]:
    """One bucket into one worker; (ok, SGLang's message). Never raises for SGLang's refusal."""
    body = {"serialized_named_tensors": payloads, "load_format": None, "flush_cache": False}
    try:
        async with session.post(f"{url}/update_weights_from_tensor", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            text = await r.text()
            try:
                reply = await r.json(content_type=None)
            except ValueError:
                reply = {}
    except (aiohttp.ClientError, TimeoutError) as exc:
        return False, f"{url}: {type(exc).__name__}: {exc}"
    ok = r.status == 200 and bool(reply.get("success", True)) if isinstance(reply, dict) else r.status == 200
    message = reply.get("message", text) if isinstance(reply, dict) else text
    return ok, f"{url}: {message}" if not ok else str(message)
