# Every target creates/reuses .venv at the repo root (see scripts/setup.sh).
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup protos test test-fast lint demo bench clean help

help:
	@echo "make setup   - create/reuse .venv and install everything pinned (CPU)"
	@echo "make protos  - regenerate compactor/service/gen from protos/ (commit the result)"
	@echo "make test    - the whole test suite (real model, real SGLang server on CPU)"
	@echo "make test-fast - the suite without SGLang server tests"
	@echo "make lint    - ruff + mypy"
	@echo "make demo    - stock SGLang vs compacted shared prefixes, embedded SmolLM2-135M (CPU, ~6 min)"
	@echo "make bench   - benchmarks (JSON + PNG under benchmarks/results/)"

setup:
	@bash scripts/setup.sh

protos: setup
	$(PY) scripts/gen_protos.py

# pytest exits 5 when it collects no test: say so loudly but do not fail on it; any other
# non-zero exit (a failure, an error, an interrupted run) fails the target.
test: setup
	@$(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests"; exit 0; fi; exit $$rc

test-fast: setup
	$(PY) -m pytest -q -m "not sglang"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy compactor sglang_ext kernels harness

demo: setup
	$(PY) -m harness.demo

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf build *.egg-info .pytest_cache .mypy_cache .ruff_cache
