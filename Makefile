# Every target creates the environments it needs (outside the clone, keyed by a hash of the
# pin files in requirements/) and reuses them while the pins are unchanged.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
ENV := scripts/env.sh
PYTEST_ARGS ?=
# installs this checkout into an environment (editable, no dependency changes): fast, idempotent
define install
	log=$$(mktemp); $(1) -m pip install -q --no-deps -e . >$$log 2>&1 || { cat $$log; rm -f $$log; exit 1; }; rm -f $$log
endef

.PHONY: help demo test test-paddleformers test-paddlenlp bench faults python-path envs clean

help:
	@echo "make demo         train a tiny Llama on CPU with the PaddleFormers Trainer, exporting HF snapshots"
	@echo "make test         the whole suite: PaddleFormers env, then PaddleNLP env (real client checks included)"
	@echo "make bench        benchmarks (results in bench/results/*.json)"
	@echo "make faults       the long crash loop and bad-input count (bench/results/faults.json)"
	@echo "make python-path  print the main environment's python (creates it if needed)"

python-path:
	@$(ENV) paddleformers

envs:
	@$(ENV) paddleformers >/dev/null && $(ENV) paddlenlp >/dev/null && $(ENV) hf >/dev/null

demo:
	@PY=$$($(ENV) paddleformers); $(call install,$$PY); \
	$$PY -m paddle_fullparam_callbacks demo --output-dir demo_output $(ARGS)

test: test-paddleformers test-paddlenlp

test-paddleformers:
	@PY=$$($(ENV) paddleformers); HF=$$($(ENV) hf); $(call install,$$PY); \
	echo "== tests in the PaddleFormers environment"; \
	PFC_HF_PYTHON=$$HF $$PY -m pytest tests --ignore-glob='tests/test_pnlp_*' $(PYTEST_ARGS)

test-paddlenlp:
	@PY=$$($(ENV) paddlenlp); HF=$$($(ENV) hf); $(call install,$$PY); \
	echo "== tests in the PaddleNLP environment"; \
	PFC_HF_PYTHON=$$HF $$PY -m pytest tests --ignore-glob='tests/test_pf_*' $(PYTEST_ARGS)

bench:
	@PY=$$($(ENV) paddleformers); $(call install,$$PY); \
	$$PY bench/export_single.py && $$PY bench/assembler.py && $$PY bench/async_stall.py

faults:
	@PY=$$($(ENV) paddleformers); $(call install,$$PY); \
	$$PY tests/faults/crash_loop.py --long

clean:
	rm -rf demo_output .pytest_cache .hypothesis *.egg-info
