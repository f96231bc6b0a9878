PY ?= python3
VENV := .venv
STAMP := $(VENV)/.setup-stamp
PYTEST_ARGS ?=
# SpecForge's own modules are the tests' oracles for drafts and losses. Its package pins a CUDA torch
# and a serving stack, and pip cannot say --no-deps for one requirement of an extra, so setup
# installs it on its own, without dependencies, beside the dev extra's CPU torch.
SPECFORGE := specforge==0.2.0

.PHONY: setup test test-tpu-full demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip
	# tpu: libtpu, so the suite's TPU compile tier runs here without a TPU (deviceless AOT)
	$(VENV)/bin/pip install -e '.[dev,tpu]'
	$(VENV)/bin/pip install --no-deps '$(SPECFORGE)'
	touch $(STAMP)

# pytest exits 5 when it collects nothing; that must fail too, and it does because
# make propagates every non-zero status.
test: setup
	$(VENV)/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -W ignore::DeprecationWarning --durations=15 -m "not tpu_full" $(PYTEST_ARGS)

# The full-width TPU compiles (Kimi-K2.5 INT4, DeepSeek-V3 FP8 cut to a few layers): ~10-20 min.
test-tpu-full: setup
	$(VENV)/bin/python -m pytest -m tpu_full -W ignore::DeprecationWarning $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/python serve.py

# Every benchmark, one after another: JSON in benchmarks/results/, then benchmarks/RESULTS.md from it.
# BENCH_ARGS="--quick" checks the pipeline in minutes; "--only speedup,convert" runs a subset.
bench: setup
	$(VENV)/bin/python benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV)
