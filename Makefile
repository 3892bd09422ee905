# KeepState: two commands for a new user on a fresh Debian 12 machine (as root):
#   make up     installs everything, builds the base template, then serves on 127.0.0.1:3000
#   make test   installs everything, then runs every test
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
VENV_E2B250 := .venv-e2b250
VENV_E2B245 := .venv-e2b245
JS_TESTS := tests/js
LISTEN ?= 127.0.0.1:3000

.PHONY: setup host venv up test bench clean-test

setup: host venv

host:
	@bash scripts/setup-host.sh

venv: $(VENV)/.installed $(VENV_E2B250)/.installed $(VENV_E2B245)/.installed $(JS_TESTS)/node_modules/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $@

# The last SDK release on the v1 routes, in a venv of its own: its pins conflict with the newest SDK's.
$(VENV_E2B250)/.installed: tests/requirements-e2b250.txt
	@test -x $(VENV_E2B250)/bin/python || $(PYTHON) -m venv $(VENV_E2B250)
	@$(VENV_E2B250)/bin/pip install --quiet --disable-pip-version-check -r tests/requirements-e2b250.txt
	@touch $@

# A release that refuses API keys not in E2B's format ("e2b_" + hex) before it sends anything.
$(VENV_E2B245)/.installed: tests/requirements-e2b245.txt
	@test -x $(VENV_E2B245)/bin/python || $(PYTHON) -m venv $(VENV_E2B245)
	@$(VENV_E2B245)/bin/pip install --quiet --disable-pip-version-check -r tests/requirements-e2b245.txt
	@touch $@

# The stock JS SDK for tests/js (run by tests/sdk/test_js_sdk.py), with the node and npm scripts/setup-host.sh
# installed: `npm ci` installs exactly what the lock pins. e2b declares node >= 20.18.1 and Debian 12's nodejs is
# 18.20; the SDK works on it (tests/js imports its ESM build), so npm's engine warnings are kept out (--loglevel).
$(JS_TESTS)/node_modules/.installed: $(JS_TESTS)/package-lock.json
	@cd $(JS_TESTS) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

up: setup
	@names=$$($(BIN)/python -c "from keepstate.template.definition import load_all; print(' '.join(load_all()))"); \
	for t in $$names; do $(BIN)/keepstate template build $$t >/dev/null || exit 1; done; \
	key=$$($(BIN)/keepstate keys dev); ca=$$($(BIN)/keepstate tls trust 2>/dev/null); \
	echo "# E2B_DOMAIN alone, as the next major SDK knows it (https://api.localhost:3443; *.localhost must resolve"; \
	echo "# to this host: systemd-resolved or libnss-myhostname do that; in production a wildcard DNS name, serve --domain):"; \
	echo "export E2B_DOMAIN=localhost:3443 E2B_API_KEY=$$key SSL_CERT_FILE=$$ca NODE_EXTRA_CA_CERTS=$$ca"; \
	echo "# or, with any SDK release before it:"; \
	echo "export E2B_API_URL=http://$(LISTEN) E2B_SANDBOX_URL=http://$(LISTEN) E2B_API_KEY=$$key"; \
	exec $(BIN)/keepstate serve --listen $(LISTEN) --tls-self-signed --warm $$(echo $$names | tr ' ' ,)

# Static checks first (ruff, mypy, generated protocol modules, the agent's generated pins), then every test.
test: setup lint proto-check
	@$(BIN)/python scripts/agent-requirements.py --check
	@bash scripts/test.sh

bench: setup
	@$(BIN)/python benchmarks/sandbox.py

# keepstate/agent/requirements.txt from pyproject.toml's `agent` extra (--check: fail if it differs; needs PyPI).
.PHONY: agent-requirements
agent-requirements: $(VENV)/.installed
	@$(BIN)/python scripts/agent-requirements.py

# Static checks (configured in pyproject.toml).
.PHONY: lint
lint: $(VENV)/.installed
	@status=0; $(BIN)/ruff check keepstate tests benchmarks scripts examples || status=1; \
	$(BIN)/mypy keepstate || status=1; exit $$status

# The agent's protocol modules, generated from their .proto files (keepstate/agent/proto/README.md). The code
# generators live in a venv of their own (they are not runtime dependencies); protoc-gen-py must match the
# runtime protobuf-py and protoc-gen-connectrpc the runtime connectrpc (keepstate/agent/requirements.txt).
VENV_PROTO := .venv-proto
PROTO_TOOLS := grpcio-tools==1.85.1 protoc-gen-py==0.6.0 protoc-gen-connectrpc==0.12.1
PROTO_DIR := keepstate/agent/proto
PROTOS := $(PROTO_DIR)/process/process.proto $(PROTO_DIR)/filesystem/filesystem.proto
PROTO_MODULES := process/process_pb.py process/process_connect.py filesystem/filesystem_pb.py \
	filesystem/filesystem_connect.py
# protoc names each module's source relative to -I ("Generated from process/process.proto"), and finds the
# plugins (protoc-gen-py, protoc-gen-connectrpc) on PATH. $(1): the output directory.
PROTOC = PATH=$(abspath $(VENV_PROTO))/bin:$$PATH $(VENV_PROTO)/bin/python -m grpc_tools.protoc -I $(PROTO_DIR) \
	--py_out=$(1) --connectrpc_out=$(1) $(PROTOS)

$(VENV_PROTO)/.installed: Makefile
	@test -x $(VENV_PROTO)/bin/python || $(PYTHON) -m venv $(VENV_PROTO)
	@$(VENV_PROTO)/bin/pip install --quiet --disable-pip-version-check $(PROTO_TOOLS)
	@touch $@

# Generated into a scratch directory and copied: protoc also writes the packages' __init__.py, which are ours.
.PHONY: proto proto-check
proto: $(VENV_PROTO)/.installed
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && $(call PROTOC,$$tmp) && \
	for m in $(PROTO_MODULES); do cp "$$tmp/$$m" "$(PROTO_DIR)/$$m"; done

# Fails when a committed module is not what its .proto generates (edited by hand, or the .proto changed alone).
proto-check: $(VENV_PROTO)/.installed
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && $(call PROTOC,$$tmp) || exit 1; \
	status=0; for m in $(PROTO_MODULES); do \
	  if ! cmp -s "$$tmp/$$m" "$(PROTO_DIR)/$$m"; then \
	    echo "proto-check: $(PROTO_DIR)/$$m is not what $(PROTO_DIR)/$${m%_*}.proto generates" \
	      "(run 'make proto' and commit the result):" >&2; \
	    diff -u "$(PROTO_DIR)/$$m" "$$tmp/$$m" | head -40 >&2; status=1; \
	  fi; \
	done; exit $$status
