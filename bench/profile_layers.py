"""Where one request's CPU goes, layer by layer, without a profiler's inflation of pure Python.

Wraps the request path's functions (the middlewares, the handler, parse, the pipeline's steps, the SGLang
call, metrics, aiohttp's response and client calls) with a timer of the thread's CPU from call to return,
then drives N requests at c=1 through the app in this process, in front of the simulator (a subprocess,
zero latency). At c=1 nothing else runs while a request waits on SGLang, so a layer's figure is its own
work plus the layers inside it; a layer's own cost is its figure minus its inner layers'. Each timer adds
~0.3-1 us to its layer and to every layer outside it. `--path token-in` (/inference/v1/generate, the
chat prompt's ids) or `chat` (a unique ~200-token prompt each, every render a miss):

    python bench/profile_layers.py --path token-in -n 2000
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import importlib
import inspect
import os
import sys
import time

import aiohttp
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_proxy import app_in_process, free_port, start
from bench_vs_smg import OUT_TOKENS, chat_messages

TOT: dict[str, int] = collections.defaultdict(int)
CNT: dict[str, int] = collections.defaultdict(int)
clock = time.thread_time_ns

def wrap(name, f):
    """`f` timed: its thread CPU from call to return (a coroutine's whole life) added to TOT[name]."""
    if inspect.iscoroutinefunction(f):
        @functools.wraps(f)
        async def w(*a, **k):
            t = clock()
            try:
                return await f(*a, **k)
            finally:
                TOT[name] += clock() - t
                CNT[name] += 1
    else:
        @functools.wraps(f)
        def w(*a, **k):
            t = clock()
            try:
                return f(*a, **k)
            finally:
                TOT[name] += clock() - t
                CNT[name] += 1
    return w

TARGETS = [
 ("aiohttp.web_app", "Application._handle"),
 ("aiohttp.web_protocol", "RequestHandler._handle_request"),
 ("token_proxy.ops.observe", "observe_requests"),
 ("token_proxy.ops.drain", "drain_deadline"),
 ("token_proxy.ops.middleware", "openai_errors"),
 ("token_proxy.ops.auth", "access_control"),
 ("token_proxy.ops.admission", "admission_control"),
 ("token_proxy.api.generate.endpoint", "generate_tokens"),
 ("token_proxy.api.chat.endpoint", "chat_completions"),
 ("token_proxy.http_io", "read_json"),
 ("token_proxy.http_io", "read_body"),
 ("token_proxy.http_io", "json_response"),
 ("token_proxy.api.generate.request", "parse_generate_tokens"),
 ("token_proxy.api.fields", "token_id_list"),
 ("token_proxy.api.chat.request", "parse_chat_request"),
 ("token_proxy.api.sampling", "parse_sampling"),
 ("token_proxy.api.chat.request", "ChatFeatures.for_request"),
 ("token_proxy.api.chat.endpoint", "tool_flags"),
 ("token_proxy.pipeline.run", "run_pipeline"),
 ("token_proxy.pipeline.run", "prepare"),
 ("token_proxy.pipeline.run", "_serve"),
 ("token_proxy.pipeline.run", "output_rules"),
 ("token_proxy.pipeline.run", "response_id"),
 ("token_proxy.pipeline.run", "max_tokens_for"),
 ("token_proxy.sglang.payload", "sglang_request"),
 ("token_proxy.pipeline.call", "generate_whole"),
 ("token_proxy.sglang.client", "SGLangClient.generate"),
 ("token_proxy.sglang.client", "aborting_on_exit"),
 ("token_proxy.pipeline.output_rules", "OutputRules.whole"),
 ("token_proxy.pipeline.output_rules", "OutputRules.usage"),
 ("token_proxy.api.chat.format", "ChatFormatter.response"),
 ("token_proxy.api.generate.format", "GenerateFormatter.response"),
 ("token_proxy.api.chat.endpoint", "ChatEndpoint.formatter"),
 ("token_proxy.api.chat.endpoint", "ChatEndpoint.prompt_ids"),
 ("token_proxy.tokenization.renderer", "PromptRenderer.render_chat"),
 ("token_proxy.ops.metrics", "ProxyMetrics.observe"),
 ("token_proxy.ops.metrics", "ProxyMetrics._observe_vllm"),
 ("token_proxy.ops.access_log", "log_request"),
 ("token_proxy.pipeline.request_state", "add_request_id_header"),
 ("token_proxy.http_io", "send_response_headers"),
 ("token_proxy.pipeline.request_state", "RequestStats.note_whole_reply"),
 ("aiohttp.web_response", "Response.__init__"),
 ("aiohttp.web_response", "StreamResponse.prepare"),
 ("aiohttp.web_response", "Response.write_eof"),
 ("aiohttp.client", "ClientSession._request"),
]

def install():
    """Every module-level reference to a target replaced by its timed wrapper (before create_app)."""
    import token_proxy.app
    import token_proxy.routes  # noqa: F401
    mods = [m for n, m in list(sys.modules.items()) if n.startswith("token_proxy") and m]
    for modname, attr in TARGETS:
        mod = importlib.import_module(modname)
        if "." in attr:
            cls, meth = attr.split(".")
            klass = getattr(mod, cls)
            raw = klass.__dict__[meth]
            if isinstance(raw, classmethod):
                setattr(klass, meth, classmethod(wrap(attr, raw.__func__)))
            else:
                setattr(klass, meth, wrap(attr, raw))
            continue
        f = getattr(mod, attr)
        w = wrap(attr, f)
        if hasattr(f, "__middleware_version__"):
            w.__middleware_version__ = 1
        for m in mods:
            for k, v in list(vars(m).items()):
                if v is f:
                    setattr(m, k, w)
    routes = sys.modules["token_proxy.routes"]
    for route in routes.ROUTES:  # the route table holds the handlers themselves
        name = getattr(route.handler, "__name__", "")
        if name in ("generate_tokens", "chat_completions"):
            object.__setattr__(route, "handler", getattr(routes, name))


async def main_async(args, backend, ids):
    runner, port = await app_in_process(backend, args.tokenizer)
    path = "/v1/chat/completions" if args.path == "chat" else "/inference/v1/generate"
    def body(i):
        if args.path == "chat":
            return orjson.dumps({"messages": chat_messages(i), "max_tokens": OUT_TOKENS, "ignore_eos": True, "temperature": 0})
        return orjson.dumps({"token_ids": ids, "sampling_params": {"max_tokens": OUT_TOKENS, "ignore_eos": True, "temperature": 0}})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(i):
            async with s.post(f"http://127.0.0.1:{port}{path}", data=body(i), headers={"Content-Type": "application/json"}) as r:
                data = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{r.status} {data[:300]!r}")

        for i in range(200):  # warm
            await one(10**8 + i)
        TOT.clear()
        CNT.clear()
        t0 = time.thread_time_ns()
        for i in range(args.n):
            await one(i)
        cpu = time.thread_time_ns() - t0
    await runner.cleanup()
    return cpu

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default="chat", choices=("chat", "token-in"))
    p.add_argument("-n", type=int, default=2000)
    p.add_argument("--raw", action="store_true", help="no timers: the whole thread's CPU per request only")
    args = p.parse_args()
    from token_proxy.simulator.builtin_tokenizer import ensure_builtin_tokenizer
    args.tokenizer = str(ensure_builtin_tokenizer())
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(args.tokenizer).encode(chat_messages(1)[1]["content"])
    if not args.raw:
        install()
    port = free_port()
    sim = start([sys.executable, "-m", "token_proxy.simulator", "--port", str(port), "--tokenizer", args.tokenizer,
                 "--ttft-ms", "0", "--tpot-ms", "0", "--log-level", "warning"], f"http://127.0.0.1:{port}")
    try:
        cpu = asyncio.run(main_async(args, f"http://127.0.0.1:{port}", ids))
    finally:
        sim.terminate()
    n = args.n
    print(f"{args.path}: {len(ids)} ids; thread CPU per request (server+client) {cpu/n/1000:.1f} us")
    for _module, attr in TARGETS:
        if CNT[attr]:
            print(f"  {attr:45s} {TOT[attr] / n / 1000:8.1f} us  calls/req {CNT[attr] / n:.2f}")

if __name__ == "__main__":
    main()
