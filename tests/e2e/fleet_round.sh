#!/bin/bash
# The GPU fleet round (issue 28) on a host with 4 GPUs, in two device calls (64 MiB each: the SGLang bundle and
# the router do not fit in one). Run through tests/e2e/gpu_round.sh:
#   bash tests/e2e/gpu_round.sh fleet-start   call 1, carries .gpu/sglang-site312.tar.xz .gpu/tok.tar.xz
#                                             .gpu/make_model.py: unpack, build the tiny model, start worker A (GPU 1,
#                                             :30001) and B (GPU 2, :30002) in their own sessions (they outlive the call)
#   bash tests/e2e/gpu_round.sh fleet         call 2 (within 30 s: the machine stays warm), carries
#                                             .gpu/router.tar.xz .whl: wheels, sglang-router (round_robin, :30000) in
#                                             front of the workers, the proxy (:8000) in front of it, then
#                                             bench/fleet_round.py with the trainer on GPU 0 -> $OUT/fleet.md, fleet.json
# The two calls from the device tool (each sends main's tree, ~3.2 MB, plus what `carry` names; 64 MiB a call):
#   1. kind nvidia-h100-x4, carry .gpu/sglang-site312.tar.xz (47.0 MB) .gpu/tok.tar.xz (1.9 MB) .gpu/make_model.py
#      -> ~52 MB; command: bash tests/e2e/gpu_round.sh fleet-start   (~150 s: SGLang's cold start was 119 s on an H100)
#   2. at once (the machine goes back after 30 s idle), carry .gpu/router.tar.xz (17.5 MB: sglang-router 0.3.2, its .so
#      stripped) .whl (10.9 MB) -> ~32 MB; command: bash tests/e2e/gpu_round.sh fleet   (~5 min)
#   Carrying all of .gpu in one call is 69.6 MB with the tree: over the limit.
# Seen on the H100 host (2026-11-27, main 2d480d5): the bundle unpacks in 3 s; sglang-router answers /health ~17 s after
# its start and lists its workers later still (so this waits for /workers); on 2d480d5, behind the router the proxy
# could not learn the context length and a streamed chat through it stopped after 1 token (issue 28, 1): fixed, so
# the proxy here is started without --context-length.
# `fleet` also starts the workers if they are not up (one call would do, were it not for the 64 MiB).
# FLEET_SIM=1: the same on CPU, simulators as workers and a gloo trainer (FLEET_TRAINER_PYTHON: a python with torch).
#   FLEET_SIM=1 FLEET_PORTS="39100 39101 39102 39103 39104" FLEET_DIR=/tmp/fleet-sim FLEET_PYTHON=VENV/bin/python \
#   FLEET_TRAINER_PYTHON=VENV/bin/python FLEET_TOKENIZER=~/.cache/sglang-token-proxy/qwen2-builtin-tokenizer-v2 \
#   PYTHONPATH=$PWD FLEET_ARGS="--concurrency 8 --window-s 2" bash tests/e2e/gpu_round.sh fleet   (~3 min; VENV: torch
#   CPU + this package; FLEET_ROUTER_PYTHON: a python with sglang-router if VENV lacks it; kill -- -PID of each
#   FLEET_DIR/*.pid afterwards)
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 ...); NCCL_CUMEM_ENABLE is NOT set: the trainer runs with the
# environment a trainer has by default, so the round shows whether the broadcaster copes on its own.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu-round}; mkdir -p "$OUT"; export FLEET_DIR=${FLEET_DIR:-/tmp/fleet}; F=$FLEET_DIR; mkdir -p $F
# ports: router, worker A, worker B, proxy, router's Prometheus (FLEET_PORTS moves them, e.g. on a shared CPU machine)
read -r RP AP BP PP MP <<< "${FLEET_PORTS:-30000 30001 30002 8000 29000}"
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
mode=${1:?fleet-start|fleet}; shift
SIM=${FLEET_SIM:-0}
PY=${FLEET_PYTHON:-python3}; ROUTER_PY=${FLEET_ROUTER_PYTHON:-$PY}
healthy() { $PY -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('$1',timeout=2).status!=200)" 2>/dev/null; }

start_workers() {
  if healthy "http://127.0.0.1:$AP/health" && healthy "http://127.0.0.1:$BP/health"; then log "workers A and B already up"; return 0; fi
  if [ "$SIM" != 1 ]; then
    SITE=/tmp/sglang-site; sig=$(stat -c %s .gpu/sglang-site312.tar.xz 2>/dev/null || echo none)
    if [ "$(cat $SITE/.done 2>/dev/null)" != "$sig" ]; then
      [ -f .gpu/sglang-site312.tar.xz ] || { echo "no .gpu/sglang-site312.tar.xz: carry it (call 1)"; return 1; }
      rm -rf $SITE && mkdir -p $SITE && tar xJf .gpu/sglang-site312.tar.xz -C $SITE && echo "$sig" > $SITE/.done
      log "bundle unpacked"
    fi
    [ -d /tmp/tok ] || tar xJf .gpu/tok.tar.xz -C /tmp
    if [ ! -f /tmp/tiny-qwen2/config.json ]; then
      PYTHONPATH=$SITE python3 .gpu/make_model.py /tmp/tiny-qwen2 > /dev/null && cp /tmp/tok/* /tmp/tiny-qwen2/
    fi
  fi
  local pids=""
  for w in "A 1 $AP" "B 2 $BP"; do
    set -- $w
    if healthy "http://127.0.0.1:$3/health"; then log "worker $1 already up"; continue; fi
    bash tests/e2e/fleet_worker.sh "$1" "$2" "$3" > $F/start_$1.out 2>&1 &
    pids="$pids $!"
  done
  local rc=0
  for p in $pids; do wait "$p" || rc=1; done
  cat $F/start_A.out $F/start_B.out 2>/dev/null | grep -v '^$'
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader 2>/dev/null
  return $rc
}

case "$mode" in
  fleet-start)
    start_workers || { cp $F/*.log "$OUT/" 2>/dev/null; exit 1; }
    log "workers up" ;;
  fleet)
    if [ "$SIM" != 1 ]; then
      if [ ! -f /tmp/site/.done ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
        touch /tmp/site/.done
      fi
      if [ ! -d /tmp/router-site/sglang_router ]; then
        mkdir -p /tmp/router-site && tar xJf .gpu/router.tar.xz -C /tmp/router-site || exit 1
      fi
      export PYTHONPATH=$PWD:/tmp/site:/tmp/sglang-site
      ROUTER_PATH=/tmp/router-site:/tmp/site:/tmp/sglang-site
      MODEL=/tmp/tiny-qwen2; TOK=/tmp/tok
    else
      ROUTER_PATH=${PYTHONPATH:-}; MODEL=sim; TOK=${FLEET_TOKENIZER:?FLEET_TOKENIZER: the simulator tokenizer dir}
    fi
    start_workers || { cp $F/*.log "$OUT/" 2>/dev/null; exit 1; }
    log "workers up"
    if ! healthy http://127.0.0.1:$RP/health; then
      PYTHONPATH=$ROUTER_PATH setsid $ROUTER_PY -m sglang_router.launch_router --host 127.0.0.1 --port $RP \
        --worker-urls http://127.0.0.1:$AP http://127.0.0.1:$BP --policy round_robin \
        --prometheus-port "$MP" --tokenizer-path "$TOK" --log-level warn > $F/router.log 2>&1 &
      echo $! > $F/router.pid
    fi
    # the router answers /health before it lists its workers (seen on the H100: 17 s, then 0 workers): wait for both
    for _ in $(seq 1 240); do
      [ "$(curl -s http://127.0.0.1:$RP/workers | $PY -c 'import json,sys; print(sum(w.get("is_healthy", False) for w in json.load(sys.stdin)["workers"]))' 2>/dev/null)" = 2 ] && break
      sleep 0.5
    done
    curl -s http://127.0.0.1:$RP/workers | head -c 300; echo
    healthy http://127.0.0.1:$RP/health || { tail -30 $F/router.log; cp $F/*.log "$OUT/"; exit 1; }
    log "router up"
    export FLEET_TOK=$TOK FLEET_PYTHON=$PY
    bash tests/e2e/fleet_proxy.sh kill proxy > /dev/null
    # no --context-length: behind the router the proxy learns it from the workers (issue 28, point 1)
    bash tests/e2e/fleet_proxy.sh start proxy $PP --backend http://127.0.0.1:$RP --worker http://127.0.0.1:$AP \
      --worker http://127.0.0.1:$BP || { cp $F/*.log "$OUT/" 2>/dev/null; exit 1; }
    log "proxy up"; head -40 $F/proxy.log
    if [ "$SIM" = 1 ]; then trainer="--weights sim --backend gloo --trainer-python ${FLEET_TRAINER_PYTHON:-python3}"
    else trainer="--weights $MODEL --backend nccl --device cuda --trainer-gpu 0 --push-timeout 30"; fi
    # shellcheck disable=SC2086
    timeout "${FLEET_LIMIT:-500}" $PY bench/fleet_round.py --proxy http://127.0.0.1:$PP \
      --worker http://127.0.0.1:$AP --worker http://127.0.0.1:$BP $trainer --trainer-log "$OUT/trainer.log" \
      --kill-b "kill -9 -- -\$(cat $F/B.pid)" --restart-b "bash tests/e2e/fleet_worker.sh B 2 $BP" \
      --router http://127.0.0.1:$RP --proxy-script "bash tests/e2e/fleet_proxy.sh" \
      ${FLEET_PHASES:+--phases $FLEET_PHASES} \
      --title "Fleet round ($( [ "$SIM" = 1 ] && echo simulators, gloo || echo '4 GPUs: SGLang 0.5.17 x2, sglang-router 0.3.2, NCCL'))" \
      --md-out "$OUT/fleet.md" --json-out "$OUT/fleet.json" ${FLEET_ARGS:-} 2>&1 | tee "$OUT/fleet.log" | tail -60
    rc=${PIPESTATUS[0]}
    for extra in replica other; do bash tests/e2e/fleet_proxy.sh kill $extra > /dev/null; done
    for extra in replica other; do [ -f $F/$extra.log ] && tail -c 1000000 $F/$extra.log > "$OUT/$extra.log"; done
    # the proxy's access log has a JSON line per rollout (~0.5 kB; 100k+ here): keep the rest, and its tail
    { grep -v '^{"ts"' $F/proxy.log | tail -c 3000000; tail -n 2000 $F/proxy.log; } > "$OUT/proxy.log" 2>/dev/null
    tail -c 3000000 $F/router.log > "$OUT/router.log" 2>/dev/null
    tail -c 2000000 $F/B.log > "$OUT/B.log" 2>/dev/null
    log "fleet round done (exit $rc)"; exit "$rc" ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
