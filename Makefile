# Everything runs in a local virtualenv (.venv) so a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=

.PHONY: install run test bench lint clean up down image-test

# The container stack (deploy/): SGLang on a GPU + proxy + Prometheus + Grafana; SIM=1: no GPU, the
# proxy runs its built-in simulator. Needs Docker with the compose plugin (>= 2.24.4).
COMPOSE := docker compose -f deploy/docker-compose.yml $(if $(filter 1,$(SIM)),-f deploy/docker-compose.sim.yml)
# Without the plugin, docker reads `compose -f` as its own flags ("unknown shorthand flag: 'f' in -f"):
# checked first, when `up` or `down` runs, and said in one line (make's `*** ... Stop.`).
NEED_COMPOSE = $(if $(shell docker compose version 2>/dev/null),,$(error make $@: `docker compose` (Docker's \
	Compose v2 plugin, >= 2.24.4) is not installed: install the docker-compose-plugin package (Docker's apt \
	repository, https://docs.docker.com/compose/install/linux/; Ubuntu: docker-compose-v2)))

# Installs into one .venv are serialised by a lock, so `make run` and `make test` can start side by
# side (pip must never write one environment twice at once). `make run` installs only what running
# needs; `make test` adds the test and bench extras.
LOCKED = $(PYTHON) -c 'import fcntl, subprocess, sys; lock = open(sys.argv[1], "a"); \
	fcntl.flock(lock, fcntl.LOCK_EX); sys.exit(subprocess.call(sys.argv[2:]))' $(VENV).lock

$(VENV)/.installed-run: pyproject.toml
	@echo "make: installing token-proxy and its runtime dependencies into $(VENV) (the first time takes a minute or two)..."
	@$(LOCKED) sh -c '[ -x $(PY) ] || $(PYTHON) -m venv $(VENV); \
		$(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e .' && touch $@
	@echo "make: $(VENV) is ready to run"

$(VENV)/.installed: pyproject.toml
	@echo "make: installing token-proxy with its test and bench extras into $(VENV) (the first time takes a minute or two)..."
	@$(LOCKED) sh -c '[ -x $(PY) ] || $(PYTHON) -m venv $(VENV); \
		$(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e ".[test,bench]"' && touch $@ $(VENV)/.installed-run
	@echo "make: $(VENV) is ready to test"

install: $(VENV)/.installed

run: $(VENV)/.installed-run  ## the proxy; with no BACKEND it starts the built-in SGLang simulator
	$(VENV)/bin/token-proxy $(if $(BACKEND),--backend $(BACKEND)) $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

image-test: install  ## the image built and run for real on a Docker engine (tests/serving/test_image.py)
	PY=$(PY) deploy/image_test.sh $(ARGS)

bench: install
	$(PY) bench/bench_proxy.py $(ARGS)

# ruff's rule set and import-linter's contracts live in pyproject.toml ([tool.ruff.lint], [tool.importlinter]).
lint: install
	$(PY) -m pip install -q 'ruff>=0.17.6'
	$(VENV)/bin/ruff check token_proxy tests bench
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) $(VENV).lock .pytest_cache build *.egg-info

up:  ## proxy :8000, Prometheus :9090, Grafana :3000 (SIM=1: no GPU needed)
	$(NEED_COMPOSE)$(COMPOSE) up -d --build

down:
	$(NEED_COMPOSE)$(COMPOSE) down --remove-orphans
