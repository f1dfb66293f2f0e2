# Everything runs in a local virtualenv (.venv) so a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=

.PHONY: install run test bench lint clean

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

bench: install
	$(PY) bench/bench_proxy.py $(ARGS)

lint: install
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check token_proxy tests bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
