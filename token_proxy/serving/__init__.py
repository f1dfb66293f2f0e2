"""Several serving processes on one port (`--workers N`, as `vllm serve --api-server-count N`).

"Worker" elsewhere in the house means an SGLang server (as sglang-router uses the word); here the flag
keeps vLLM's name, but the proxy's own processes are *serving processes* (process.py, process_app.py).

With N = 1 (the default) none of this runs: one process serves everything, as it always has.

With N > 1 the `token-proxy` process is a supervisor (supervisor.py) and serves no client itself:

- it starts the built-in simulator once (when there is no --backend), then
- runs the **admin owner**: the whole single-process app on a Unix socket in a private run
  directory. Pause, weight updates, fleet transactions, vLLM's RL routes, the LoRA registry, the
  SGLang pass-through and the one scrape of SGLang's /metrics (the `vllm:` view) live there, in one
  process, so an admin call behaves the same whichever serving process takes it;
- spawns N **data-plane serving processes** (process.py), each its own event loop on host:port with
  SO_REUSEPORT (the kernel spreads new connections over them). A serving process serves inference,
  tokenizer and ops routes itself and forwards every other route to the owner (forward.py);
- serving processes follow the owner's LoRA map (public name -> SGLang's internal name) and report the
  adapter versions their requests hold, so the owner unloads a replaced adapter only when no
  serving process still uses it (adapter_sync.py);
- serving processes follow the owner's news the same way: the served model's name (ART's rename) and the
  sessions finished (SkyRL's /finish_session, an owner row: every serving process drops the session before
  it answers) (owner_news.py);
- metrics: serving processes count in prometheus-client's multiprocess mode (one directory, one file per
  process and kind); every serving process's /metrics is the merged view plus one block the owner renders
  (the `vllm:` view, weight version, LoRA adapters, process_* summed over the processes) (metrics_block.py);
- SIGTERM / SIGINT to the supervisor: every serving process stops accepting and drains (--shutdown-timeout),
  then the owner and the simulator stop; exit 0. A serving process that dies ends the whole proxy (exit 1).
"""

from token_proxy.serving.serve import add_owner_planes, add_serving_planes
from token_proxy.serving.supervisor import serve_processes

__all__ = ["add_owner_planes", "add_serving_planes", "serve_processes"]
