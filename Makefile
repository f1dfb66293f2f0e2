# Everything runs in a local virtualenv (.venv) so a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=

.PHONY: install run test bench lint clean up down image-test

# The container stack (deploy/): SGLang on a GPU + proxy + Prometheus + Grafana; SIM=1: no GPU, the
# proxy runs its built-in simulator. Needs Docker with the compose plugin (>= 2.24.4).
COMPOSE := docker compose -f deploy/docker-compose.yml $(if $(filter 1,$(SIM)),-f deploy/docker-compose.sim.yml)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

run: install  ## the proxy; with no BACKEND it starts the built-in SGLang simulator
	$(VENV)/bin/token-proxy $(if $(BACKEND),--backend $(BACKEND)) $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

image-test: install  ## the image built and run for real on a Docker engine (tests/test_image.py)
	PY=$(PY) deploy/image_test.sh $(ARGS)

bench: install
	$(PY) bench/bench_proxy.py $(ARGS)

lint: install
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check token_proxy tests bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

up:  ## proxy :8000, Prometheus :9090, Grafana :3000 (SIM=1: no GPU needed)
	$(COMPOSE) up -d --build

down:
	$(COMPOSE) down --remove-orphans
