# Two commands do all the set-up: `make demo` and `make test`. Both create .venv themselves.
VENV ?= .venv
# pytest worker processes (pytest-xdist); each test file runs whole on one of them
JOBS ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

test: lint
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile

demo: $(STAMP)
	$(PY) scripts/demo.py

clean:
	rm -rf $(VENV) demo_out
