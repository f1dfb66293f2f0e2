#!/usr/bin/env bash
# `make image-test`: the image built from deploy/Dockerfile and run for real (tests/serving/test_image.py, marked
# `docker`). Gets a Docker engine first: starts dockerd when none answers (installing docker.io from the
# Debian mirror if needed, as root), and, when the Dockerfile's base image can be neither found nor pulled
# (no Docker Hub here), builds a stand-in from Debian packages with ../shared/docker/make_base_image.sh.
# With no engine the test is skipped with the reason printed. A dockerd started here is stopped on exit
# (an engine that was already running is left alone). Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BASE_IMAGE_SCRIPT=${BASE_IMAGE_SCRIPT:-../shared/docker/make_base_image.sh}
BASE=$(awk '/^FROM/ {print $2; exit}' deploy/Dockerfile)

engine() { docker info >/dev/null 2>&1; }

dockerd_pid=
stop_dockerd() {
  [ -n "$dockerd_pid" ] && kill -0 "$dockerd_pid" 2>/dev/null || return 0
  echo "image-test: stopping the dockerd started here (pid $dockerd_pid)"
  kill "$dockerd_pid"
  for _ in $(seq 1 30); do kill -0 "$dockerd_pid" 2>/dev/null || return 0; sleep 1; done
  kill -9 "$dockerd_pid" 2>/dev/null || true
}
trap stop_dockerd EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if ! engine && [ "$(id -u)" = 0 ]; then
  command -v dockerd >/dev/null || { apt-get update -qq && apt-get install -y -qq docker.io >/dev/null; }
  if command -v dockerd >/dev/null; then
    echo "image-test: starting dockerd (log: /tmp/dockerd.log)"
    nohup dockerd >/tmp/dockerd.log 2>&1 &
    dockerd_pid=$!
    for _ in $(seq 1 60); do engine || ! kill -0 "$dockerd_pid" 2>/dev/null && break; sleep 1; done
  fi
fi
if ! engine; then
  echo "image-test: SKIPPED: no Docker engine could start$([ -f /tmp/dockerd.log ] && echo ": $(tail -1 /tmp/dockerd.log)")"
elif ! docker image inspect "$BASE" >/dev/null 2>&1 && ! timeout 60 docker pull -q "$BASE" >/dev/null 2>&1; then
  if [ -f "$BASE_IMAGE_SCRIPT" ]; then
    echo "image-test: $BASE cannot be pulled; building a stand-in from Debian packages ($BASE_IMAGE_SCRIPT)"
    bash "$BASE_IMAGE_SCRIPT" "$BASE" || echo "image-test: the stand-in base image could not be built"
  else
    echo "image-test: $BASE cannot be pulled and $BASE_IMAGE_SCRIPT is not here"
  fi
fi
"$PY" -m pytest -q -p no:cacheprovider -m docker -s tests/serving/test_image.py "$@"  # not exec: the trap stops dockerd
