# shardps: the README's two commands are `make run` and `make test`; both set up .venv first.
PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip
SHARDPS  := $(VENV)/bin/shardps
STAMP    := $(VENV)/.shardps-installed
PYTEST_ARGS ?=
PORT     ?= 7070

.PHONY: run test test-fast lint setup protos bench bench-quick soak chaos torture wheelhouse images secrets clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt -e '.[worker,dev]'
	@touch $@

setup: $(STAMP)  ## create .venv and install shardps with the worker and dev extras

run: $(STAMP)  ## a local cluster (2 servers, 2 workers) trains digits-cnn; prints the baseline beside it (PORT=7070: the manager's)
	$(SHARDPS) local --servers 2 --workers 2 --model digits-cnn --mode async --baseline --port $(PORT)

# mypy cannot follow pyproject.toml's package-dir (shardps.server is server/, ...): it checks a
# tree of links laid out as the installed package. Keep the links in step with package-dir.
LINT_TREE := build/lint

lint: $(STAMP)  ## ruff and mypy on the whole repository (make test and make test-fast run it first)
	$(VENV)/bin/ruff check .
	@rm -rf $(LINT_TREE) && mkdir -p $(LINT_TREE)/shardps
	@for entry in shardps/*; do ln -s "$(CURDIR)/$$entry" $(LINT_TREE)/shardps/; done
	@for pkg in server worker protos tools; do ln -s "$(CURDIR)/$$pkg" $(LINT_TREE)/shardps/$$pkg; done
	$(VENV)/bin/mypy -p shardps      # mypy_path (pyproject.toml) is $(LINT_TREE)

test: $(STAMP) lint  ## every test: units, RPC, multi-process, chaos, Prometheus, Docker
	$(PY) -m pytest $(PYTEST_ARGS)

FAST := not slow and not docker and not chaos and not prometheus

test-fast: $(STAMP) lint  ## units and in-process RPC tests only (< 1 min): no processes, nothing over ~2 s
	$(PY) -m pytest -q -m "$(FAST)" $(PYTEST_ARGS)

protos: $(STAMP)  ## regenerate the committed protobuf code after editing protos/v1/*.proto
	$(PY) protos/generate.py

bench: $(STAMP)  ## the full benchmark (writes bench/results/latest.json)
	$(SHARDPS) bench --full

bench-quick: $(STAMP)  ## the benchmark in under 10 minutes
	$(SHARDPS) bench

soak: $(STAMP)  ## 60 s load test: 16 clients against 2 servers
	$(PY) -m pytest tests/test_soak.py --soak-seconds 60 -s

TORTURE_MINUTES ?= 30
TORTURE_ARGS    ?=

torture: $(STAMP)  ## the fault-schedule verifier for TORTURE_MINUTES (30): kills, pauses, restarts; checker's verdict table
	$(PY) -m shardps.tools.verify --minutes $(TORTURE_MINUTES) $(if $(SEED),--seed $(SEED)) $(TORTURE_ARGS)

COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)

wheelhouse: $(STAMP)  ## wheels for offline image builds (OFFLINE=1), in ./wheelhouse
	$(PIP) wheel -q -c constraints.txt -w wheelhouse '.[worker]' 'setuptools>=77'
	rm -f wheelhouse/shardps-*.whl

images: wheelhouse  ## the server and worker images, built offline from ./wheelhouse
	OFFLINE=1 $(COMPOSE) build manager worker

secrets: $(STAMP)  ## development certificates and tokens for docker-compose.tls.yml, in deploy/secrets/
	$(SHARDPS) dev-certs deploy/secrets --force
	$(PY) -c "import secrets; print(secrets.token_urlsafe(32), end='', file=open('deploy/secrets/admin-token', 'w'))"
	$(PY) -c "import secrets; print(secrets.token_urlsafe(32), end='', file=open('deploy/secrets/token-key', 'w'))"
	chmod 0644 deploy/secrets/*   # readable by the images' non-root user: development only

chaos: $(STAMP)  ## only the chaos suite (also part of make test)
	$(PY) -m pytest -m chaos -s $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
