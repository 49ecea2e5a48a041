# Fresh machine: `make run` (default job) and `make test` (test suite) create .venv on demand.
# Sweeps: `make sweep NAME=degrees_8` runs sweeps/degrees_8.yaml; `make compare SWEEP=<dir>`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# The CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

# `make parity` checks every layout against a single process (README "Is my layout correct?").
PARITY_ARGS ?= model=llama3_tiny

.PHONY: run test test-fast parity venv clean sweep compare

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

run: venv
	$(PY) -m hsdp_runner $(ARGS)

sweep: venv
	@test -n "$(NAME)" || { echo "usage: make sweep NAME=<sweeps/NAME.yaml> [ARGS='overrides']"; exit 2; }
	$(PY) -m hsdp_runner --config-dir sweeps --config-name $(NAME) $(ARGS)

compare: venv
	@test -n "$(SWEEP)" || { echo "usage: make compare SWEEP=<sweep dir> [ARGS=--wandb-report]"; exit 2; }
	$(PY) -m hsdp_runner.compare $(SWEEP) $(ARGS)

parity: venv
	$(PY) -m hsdp_runner.parity $(PARITY_ARGS)

test: venv
	WANDB_MODE=offline $(PY) -m pytest -q tests $(ARGS)

# The tests that start no worker process (pyproject.toml's `multiprocess` marker).
test-fast: venv
	WANDB_MODE=offline $(PY) -m pytest -q -m "not multiprocess" tests $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
