PY ?= python3
VENV := .venv
STAMP := $(VENV)/.setup-stamp
PYTEST_ARGS ?=

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip
	$(VENV)/bin/pip install -e '.[dev]'
	touch $(STAMP)

# pytest exits 5 when it collects nothing; that must fail too, and it does because
# make propagates every non-zero status.
test: setup
	$(VENV)/bin/python -m pytest -n 2 --dist loadfile -W ignore::DeprecationWarning $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/python serve.py

bench: setup
	$(VENV)/bin/python benchmarks/target_decode.py
	$(VENV)/bin/python benchmarks/spec_decode.py

clean:
	rm -rf $(VENV)
