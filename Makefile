# Two commands do all the set-up: `make demo` and `make test`. Both create .venv themselves.
VENV ?= .venv
# the interpreter the venv is made from: Python 3.11 (pyproject.toml), e.g. make demo PYTHON=python3.11
PYTHON ?= python3
# pytest worker processes (pytest-xdist); each test file runs whole on one of them; three on two cores
# (docs/development.md)
JOBS ?= 3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; sys.exit(None if v == (3, 11) else "error: $(PYTHON) is \
	Python %d.%d; this project needs 3.11 (pyproject.toml): make $(MAKECMDGOALS) PYTHON=python3.11" % v)'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,eval,tensorboard]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

test: lint
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile --durations=15

demo: $(STAMP)
	$(PY) scripts/demo.py

clean:
	rm -rf $(VENV) demo_out
