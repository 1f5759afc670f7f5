# `make run`  : create the environment if needed, then run the main job.
# `make test` : create the environment if needed, then run the test suite.
# `make docs` : build the API reference from the docstrings into site/ (warnings are errors).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# GPU machines bring their own torch; CPU machines get the pinned CPU build.
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: run test docs env clean

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifneq ($(HAS_CUDA),1)
	$(PY) -m pip install -q torch==2.13.0
endif
	$(PY) -m pip install -q -e '.[test]'
	touch $@

run: env
	$(PY) -m replayssm.cli run

# Two pytest workers, one thread each (torch's default thread count collapses when the
# workers share two cores); TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: env
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $(TEST_WORKERS)

docs: env
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) site
