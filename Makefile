# One entry point for setup, the main job and the tests. Every pin lives in constraints.txt.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PYTHON3 ?= python3

.PHONY: install run test test-unit bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) -m pip check
	touch $(STAMP)

install: $(STAMP)

# The main job with its defaults: small GPT, 2..3 workers, file storage under runs/.
RUN_ARGS ?= --storage runs/pretrain --workers 2:3 --steps 200 --checkpoint-every 50
run: install
	$(PY) examples/pretrain.py $(RUN_ARGS)

test: install
	$(PY) -m pytest

test-unit: install
	$(PY) -m pytest tests/unit

bench: install
	$(PY) benchmarks/recovery.py

clean:
	rm -rf $(VENV) runs .pytest_cache
