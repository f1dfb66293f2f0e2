"""A zero-latency stand-in of SGLang's gRPC scheduler (`sglang.grpc.scheduler.SglangScheduler`), for SMG.

Answers Generate with a fixed number of tokens at once (per-token chunks then a complete when
streamed; one complete otherwise) and the metadata calls SMG makes when it registers a worker.
The stubs are generated at start from the .proto that the `smg-grpc-proto` package ships (nothing
generated is committed). Run it with a Python that has `smg-grpc-proto` and `grpcio-tools`:

    /tmp/venv-smg/bin/python bench/smg_standin.py --port 30001 --tokenizer DIR [--tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import tempfile


def generated_stubs():
    """Compile sglang_scheduler.proto (and common.proto) into a temp dir; return (pb2, pb2_grpc)."""
    import grpc_tools
    import smg_grpc_proto
    from grpc_tools import protoc

    proto_dir = os.path.join(os.path.dirname(smg_grpc_proto.__file__), "proto")
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    out = tempfile.mkdtemp(prefix="smg-stubs-")
    for name in ("common.proto", "sglang_scheduler.proto"):
        rc = protoc.main(["protoc", f"-I{proto_dir}", f"-I{well_known}", f"--python_out={out}",
                          f"--grpc_python_out={out}", os.path.join(proto_dir, name)])
        if rc != 0:
            raise SystemExit(f"protoc failed on {name} ({proto_dir})")
    sys.path.insert(0, out)
    return importlib.import_module("sglang_scheduler_pb2"), importlib.import_module("sglang_scheduler_pb2_grpc")


def build_servicer(pb2, pb2_grpc, args):
    class Scheduler(pb2_grpc.SglangSchedulerServicer):
        async def Generate(self, request, context):  # noqa: N802 (the proto's name)
            n = request.sampling_params.max_new_tokens or args.tokens
            prompt = len(request.tokenized.input_ids)
            ids = [(args.first_id + i) % args.vocab for i in range(n)]
            if request.stream:
                for i, tok in enumerate(ids):
                    yield pb2.GenerateResponse(request_id=request.request_id, chunk=pb2.GenerateStreamChunk(
                        token_ids=[tok], prompt_tokens=prompt, completion_tokens=i + 1))
                ids = []
            yield pb2.GenerateResponse(request_id=request.request_id, complete=pb2.GenerateComplete(
                output_ids=ids, finish_reason="length", prompt_tokens=prompt, completion_tokens=n))

        async def HealthCheck(self, request, context):  # noqa: N802
            return pb2.HealthCheckResponse(healthy=True, message="ok")

        async def Abort(self, request, context):  # noqa: N802
            return pb2.AbortResponse(success=True)

        async def GetModelInfo(self, request, context):  # noqa: N802
            return pb2.GetModelInfoResponse(
                model_path=args.tokenizer, tokenizer_path=args.tokenizer, is_generation=True,
                served_model_name="bench", max_context_length=32768, vocab_size=args.vocab,
                model_type="qwen2", architectures=["Qwen2ForCausalLM"], eos_token_ids=[151645],
                max_req_input_len=32000)

        async def GetServerInfo(self, request, context):  # noqa: N802
            return pb2.GetServerInfoResponse(sglang_version="0.5.17", server_type="grpc",
                                             max_total_num_tokens=1 << 20)

        async def GetLoads(self, request, context):  # noqa: N802
            return pb2.GetLoadsResponse(version="0.5.17", dp_rank_count=1)

    return Scheduler()


async def serve(args) -> None:
    import grpc

    pb2, pb2_grpc = generated_stubs()
    server = grpc.aio.server()
    pb2_grpc.add_SglangSchedulerServicer_to_server(build_servicer(pb2, pb2_grpc, args), server)
    try:  # SMG probes grpc.health.v1 too
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        checker = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        await checker.set("", health_pb2.HealthCheckResponse.SERVING)
        await checker.set("sglang.grpc.scheduler.SglangScheduler", health_pb2.HealthCheckResponse.SERVING)
    except ImportError:
        pass
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    print(f"stand-in scheduler on 127.0.0.1:{args.port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokenizer", required=True, help="the tokenizer folder SMG loads (reported as model_path)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer when max_new_tokens is unset")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--first-id", type=int, default=1000, help="the first output token id (then +1 each)")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
