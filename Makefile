# Fresh machine: `make run` (default job) and `make test` (test suite) create .venv on demand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# The CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

run: venv
	$(PY) -m hsdp_runner $(ARGS)

test: venv
	WANDB_MODE=offline $(PY) -m pytest -q tests $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
