# KeepState: two commands for a new user on a fresh Debian 12 machine (as root):
#   make up     installs everything, builds the base template, then serves on 127.0.0.1:3000
#   make test   installs everything, then runs every test
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
VENV_E2B250 := .venv-e2b250
LISTEN ?= 127.0.0.1:3000

.PHONY: setup host venv up test bench clean-test

setup: host venv

host:
	@bash scripts/setup-host.sh

venv: $(VENV)/.installed $(VENV_E2B250)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $@

# The last SDK release on the v1 routes, in a venv of its own: its pins conflict with the newest SDK's.
$(VENV_E2B250)/.installed: tests/requirements-e2b250.txt
	@test -x $(VENV_E2B250)/bin/python || $(PYTHON) -m venv $(VENV_E2B250)
	@$(VENV_E2B250)/bin/pip install --quiet --disable-pip-version-check -r tests/requirements-e2b250.txt
	@touch $@

up: setup
	@names=$$($(BIN)/python -c "from keepstate.template.definition import load_all; print(' '.join(load_all()))"); \
	for t in $$names; do $(BIN)/keepstate template build $$t >/dev/null || exit 1; done; \
	echo "export E2B_API_URL=http://$(LISTEN) E2B_SANDBOX_URL=http://$(LISTEN) E2B_API_KEY=$$($(BIN)/keepstate keys dev)"; \
	exec $(BIN)/keepstate serve --listen $(LISTEN) --warm $$(echo $$names | tr ' ' ,)

test: setup
	@bash scripts/test.sh

bench: setup
	@$(BIN)/python benchmarks/sandbox.py
