#!/bin/bash
# One worker of the fleet round (tests/e2e/fleet_round.sh): start it in its own process session and wait for /health.
#   bash tests/e2e/fleet_worker.sh NAME GPU PORT
# SGLang 0.5.17 from /tmp/sglang-site (unpacked by fleet_round.sh fleet-start) on GPU $GPU, the tiny model
# /tmp/tiny-qwen2, --incremental-streaming-output --enable-metrics; log /tmp/fleet/NAME.log, process group
# /tmp/fleet/NAME.pid (kill -9 -- -PID stops it and its scheduler). FLEET_SIM=1: the simulator instead (CPU).
set -u
name=$1 gpu=$2 port=$3 F=${FLEET_DIR:-/tmp/fleet}
mkdir -p $F
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
t0=$(date +%s)
if [ "${FLEET_SIM:-0}" = 1 ]; then
  setsid ${FLEET_PYTHON:-python3} -m token_proxy.simulator --host 127.0.0.1 --port "$port" --sglang-version 0.5.17 \
    --incremental-streaming-output --log-level warning > $F/$name.log 2>&1 &
else
  CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=/tmp/sglang-site setsid python3 -m sglang.launch_server \
    --model-path /tmp/tiny-qwen2 --host 127.0.0.1 --port "$port" --enable-metrics --incremental-streaming-output \
    --attention-backend triton --sampling-backend pytorch \
    --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled \
    --mem-fraction-static 0.3 > $F/$name.log 2>&1 &
fi
echo $! > $F/$name.pid
for _ in $(seq 1 600); do
  if ${FLEET_PYTHON:-python3} -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$port/health',timeout=2).status!=200)" 2>/dev/null; then
    echo "worker $name ready on :$port (GPU $gpu) after $(( $(date +%s) - t0 )) s"; exit 0
  fi
  kill -0 "$(cat $F/$name.pid)" 2>/dev/null || { tail -30 $F/$name.log; echo "worker $name exited"; exit 1; }
  sleep 0.5
done
tail -30 $F/$name.log; echo "worker $name not healthy after 300 s"; exit 1
