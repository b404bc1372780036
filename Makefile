# Every target creates/reuses .venv at the repo root (see scripts/setup.sh).
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup kvpress-venv pd-deps protos test test-fast lint demo bench clean help

help:
	@echo "make setup   - create/reuse .venv and install everything pinned (CPU)"
	@echo "make kvpress-venv - create/reuse third_party/.kvpress-venv (NVIDIA kvpress, pinned)"
	@echo "make pd-deps - create/reuse third_party/.pd-deps (Mooncake, sglang-router: a CPU PD pair)"
	@echo "make protos  - regenerate compactor/service/gen from protos/ (commit the result)"
	@echo "make test    - the whole test suite (real model, real SGLang server, kvpress peer check; CPU)"
	@echo "make test-fast - the suite without SGLang server tests"
	@echo "make lint    - ruff + mypy"
	@echo "make demo    - stock SGLang vs compacted shared prefixes, embedded SmolLM2-135M (CPU, ~6 min)"
	@echo "make bench   - benchmarks (JSON + PNG under benchmarks/results/)"

setup:
	@bash scripts/setup.sh

# The peer implementation the kvpress cross-check test runs against (its own venv: kvpress pins
# an older transformers). Idempotent like setup; the tests fail, not skip, without it.
kvpress-venv:
	@bash scripts/setup_kvpress_venv.sh

# What a CPU prefill/decode pair needs beyond .venv (the Mooncake wheel, sglang-router, the
# libraries Mooncake links), for the PD test; pinned by sha256, idempotent, gitignored.
pd-deps: setup
	@PY=$(PY) bash scripts/setup_pd_deps.sh

protos: setup
	$(PY) scripts/gen_protos.py

# Two pytest streams side by side: the tests that start SGLang servers one after another, and
# the rest followed by the short server tests (scripts/run_tests.sh; TEST_STREAMS=1 for one).
# Any non-zero pytest exit fails the target, 5 (no test collected or run) included.
test: setup kvpress-venv pd-deps
	PY=$(PY) bash scripts/run_tests.sh

test-fast: setup kvpress-venv
	$(PY) -m pytest -q -m "not sglang"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy compactor sglang_ext compaction_kernels harness

demo: setup
	$(PY) -m harness.demo

bench: setup
	$(PY) -m benchmarks.report.run_all

clean:
	rm -rf build *.egg-info .pytest_cache .mypy_cache .ruff_cache
