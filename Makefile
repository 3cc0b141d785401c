# Every target creates the environments it needs (outside the clone, keyed by a hash of the
# pin files in requirements/) and reuses them while the pins are unchanged. The environments hold
# third-party packages only and may be shared by several clones: this checkout is never installed
# into them, it is put first on the path of every process a target starts (PYTHONPATH, inherited
# by the tests' subprocesses and by paddle.distributed.launch's ranks).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
ENV := scripts/env.sh
BASE_PYTHON := $${PFC_BASE_PYTHON:-python3}
PYTEST_ARGS ?= --durations=15
# each pass runs on TEST_WORKERS pytest-xdist workers; a file (its tests and its module fixtures, e.g. one
# launch checked by many tests) stays on one worker. TEST_WORKERS=0 runs a pass in one process. Files reach the
# workers longest first (tests/_schedule.py); xdist's own reordering (by number of tests) is off, it put the long
# files of few tests last.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
# what the PaddleFormers pass runs (tests/test_install.py builds and installs the wheel)
TESTS ?= tests
export PYTHONPATH := $(CURDIR)

.PHONY: help demo test test-paddleformers test-paddlenlp check-requirements requirements docs bench faults python-path envs fake-device clean

help:
	@echo "make demo          train a tiny Llama on CPU with the PaddleFormers Trainer, exporting HF snapshots"
	@echo "make test          the whole suite: requirements, docs and import contracts, PaddleFormers env (with the"
	@echo "                   wheel install test), then PaddleNLP env"
	@echo "make docs          the import contracts (lint-imports) and the docs site (mkdocs build --strict, into site/)"
	@echo "make bench         benchmarks (results in bench/results/*.json)"
	@echo "make faults        the long crash loop and bad-input count (bench/results/faults.json)"
	@echo "make requirements  rewrite requirements/*.txt's lower parts from pyproject.toml's extras"
	@echo "make python-path   print the main environment's python (creates it if needed)"
	@echo "make fake-device   build (or find cached) the fake accelerator plugin; prints CUSTOM_DEVICE_ROOT=... and DEVICE=..."

python-path:
	@$(ENV) paddleformers

# the fake accelerator (fake_device/): two lines on stdout, CUSTOM_DEVICE_ROOT=<dir> and DEVICE=fakedev
fake-device:
	@scripts/fake_device.sh paddleformers

envs:
	@$(ENV) paddleformers >/dev/null && $(ENV) paddlenlp >/dev/null && $(ENV) hf >/dev/null && $(ENV) docs >/dev/null && \
	$(ENV) vllm >/dev/null

# a recipe with an evaluation hook (evaluate_each_snapshot, lm_eval_each_snapshot, evaluate.* overrides) gets the hf
# environment's python as $$PFC_HF_PYTHON (the bundled evaluators need torch + transformers, lm-eval); the default
# demo does not
demo:
	@PY=$$($(ENV) paddleformers); \
	case " $(ARGS) " in *evaluate*|*lm_eval*) export PFC_HF_PYTHON=$${PFC_HF_PYTHON:-$$($(ENV) hf)};; esac; \
	$$PY -m paddle_fullparam_callbacks demo --output-dir demo_output $(ARGS)

test: check-requirements docs test-paddleformers test-paddlenlp

check-requirements:
	@$(BASE_PYTHON) scripts/sync_requirements.py --check

requirements:
	@$(BASE_PYTHON) scripts/sync_requirements.py

# mkdocs' --quiet would hide the warnings that --strict counts (mkdocs 1.6.1 then passes a broken link):
# its INFO lines are filtered instead, and pipefail keeps its status
docs:
	@PY=$$($(ENV) docs); BIN=$$(dirname "$$PY"); \
	echo "== import contracts (lint-imports) and the docs (mkdocs build --strict)"; \
	"$$BIN/lint-imports" --no-cache && NO_MKDOCS_2_WARNING=1 "$$BIN/mkdocs" build --strict --site-dir site 2>&1 | \
	  { grep -v '^INFO' || true; }

test-paddleformers:
	@PY=$$($(ENV) paddleformers); HF=$$($(ENV) hf); VLLM=$$($(ENV) vllm); \
	echo "== tests in the PaddleFormers environment"; \
	PFC_HF_PYTHON=$$HF PFC_VLLM_PYTHON=$$VLLM $$PY -m pytest $(TESTS) --ignore-glob='tests/test_pnlp_*' $(XDIST) $(PYTEST_ARGS)

test-paddlenlp:
	@PY=$$($(ENV) paddlenlp); HF=$$($(ENV) hf); VLLM=$$($(ENV) vllm); \
	echo "== tests in the PaddleNLP environment"; \
	PFC_HF_PYTHON=$$HF PFC_VLLM_PYTHON=$$VLLM $$PY -m pytest tests --ignore-glob='tests/test_pf_*' --ignore-glob='tests/unit/test_pf_*' --ignore=tests/test_install.py $(XDIST) $(PYTEST_ARGS)

bench:
	@PY=$$($(ENV) paddleformers); \
	$$PY bench/export_single.py && $$PY bench/export_fp8.py && $$PY bench/thread_scaling.py && $$PY bench/copy_floor.py && $$PY bench/gil.py && $$PY bench/export_ranks.py && $$PY bench/convert.py && $$PY bench/assembler.py && \
	$$PY bench/async_stall.py && $$PY bench/lora_merge.py && $$PY bench/eval_stall.py && $$PY bench/run_startup.py && $$PY bench/publish.py && \
	PFC_HF_PYTHON=$$($(ENV) hf) $$PY bench/lm_eval.py && PFC_HF_PYTHON=$$($(ENV) hf) $$PY bench/real_layers.py --before 0ff73e5~1 && PFC_VLLM_PYTHON=$$($(ENV) vllm) $$PY bench/serve.py

faults:
	@PY=$$($(ENV) paddleformers); \
	$$PY tests/faults/crash_loop.py --long

clean:
	rm -rf demo_output site .pytest_cache .hypothesis *.egg-info build dist
