#!/bin/bash
# One proxy of the fleet round (tests/e2e/fleet_round.sh, bench/fleet_round.py's proxy-restart, replica and
# findings-2-3 phases): started in its own process session, or killed with -9.
#   bash tests/e2e/fleet_proxy.sh start NAME PORT [token_proxy flags...]   waits for /health (60 s at most)
#   bash tests/e2e/fleet_proxy.sh kill NAME                                kill -9 its process group, wait until gone
# Log $FLEET_DIR/NAME.log (appended: a restarted proxy's first life stays readable), process group
# $FLEET_DIR/NAME.pid; the tokenizer is $FLEET_TOK, the python $FLEET_PYTHON (both exported by fleet_round.sh).
set -u
F=${FLEET_DIR:-/tmp/fleet}; PY=${FLEET_PYTHON:-python3}
mkdir -p "$F"
healthy() { $PY -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('$1',timeout=2).status!=200)" 2>/dev/null; }
case "${1:?start|kill}" in
  start)
    name=${2:?NAME} port=${3:?PORT}; shift 3
    echo "=== $(date -u +%H:%M:%S) start: --port $port $*" >> "$F/$name.log"
    setsid $PY -m token_proxy --host 127.0.0.1 --port "$port" --tokenizer "${FLEET_TOK:?FLEET_TOK}" "$@" \
      >> "$F/$name.log" 2>&1 &
    echo $! > "$F/$name.pid"
    for _ in $(seq 1 120); do
      healthy "http://127.0.0.1:$port/health" && { echo "proxy $name up on :$port"; exit 0; }
      kill -0 "$(cat "$F/$name.pid")" 2>/dev/null || break
      sleep 0.5
    done
    tail -20 "$F/$name.log"; echo "proxy $name not healthy on :$port"; exit 1 ;;
  kill)
    name=${2:?NAME}
    [ -f "$F/$name.pid" ] || { echo "no $F/$name.pid"; exit 0; }
    pid=$(cat "$F/$name.pid")
    kill -9 -- -"$pid" 2>/dev/null
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    rm -f "$F/$name.pid"; echo "proxy $name killed" ;;
  *) echo "unknown: $1"; exit 2 ;;
esac
