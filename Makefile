# Fresh machine: `make run` (default job) and `make test` (test suite) create .venv on demand.
# Sweeps: `make sweep NAME=degrees_8` runs sweeps/degrees_8.yaml; `make compare SWEEP=<dir>`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# The torch the venv gets, pinned. What `torch==2.13.0` installs depends on the index: on
# Linux x86_64 the public index's default wheel is a CUDA build; this machine's pip config
# points at a local wheel folder holding the CPU build (2.13.0+cpu). Another CUDA variant comes
# from PyTorch's own index, e.g. TORCH_SPEC='torch==2.13.0 --index-url
# https://download.pytorch.org/whl/<variant>' (docs/gpu.md, "Installing torch").
TORCH_SPEC ?= torch==2.13.0
# The spec the venv's torch was installed from. A different TORCH_SPEC reinstalls torch with
# --force-reinstall: pip alone would keep an installed 2.13.0+cpu for a CUDA 2.13.0 spec (the
# versions compare equal). pip removes the old torch only once the new one is downloaded and
# puts it back if the install fails, so a failed install keeps the old torch and the old stamp.
TORCH_STAMP := $(VENV)/.torch-spec

# `make parity` checks every layout against a single process (docs/layouts_and_parity.md).
PARITY_ARGS ?= model=llama3_tiny

.PHONY: run test test-fast lint format parity venv clean sweep compare plan FORCE

venv: $(VENV)/.installed

# Runs every time, but rewrites the stamp (and so rebuilds what depends on it) only when the
# spec differs from the recorded one and its install succeeded.
$(TORCH_STAMP): FORCE
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ "$$(cat $@ 2>/dev/null)" != '$(TORCH_SPEC)' ]; then \
	  echo "installing torch from: $(TORCH_SPEC)"; \
	  $(PY) -m pip install --quiet --disable-pip-version-check --force-reinstall $(TORCH_SPEC) && \
	  echo '$(TORCH_SPEC)' > $@; \
	fi

$(VENV)/.installed: pyproject.toml $(TORCH_STAMP)
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

# Two pytest workers (pytest-xdist; tests/conftest.py gives each a test file at a time, the
# slowest first): in one process the suite leaves the CPUs idle a quarter of the time
# (start-ups, waits for signals and timeouts). More workers oversubscribe the 4-8-rank jobs;
# TEST_WORKERS=0 runs in one process.
# The suite starts a few hundred Python processes, each importing the runner (forked ranks
# also import the test module that holds their function): where the environment sets
# PYTHONDONTWRITEBYTECODE (this machine's does), each compiled them from source again and pytest
# rewrote every test file again in each worker (~0.3 CPU-s a process, 1.5 s a worker), so the
# test targets let Python cache bytecode (in the ignored __pycache__ folders).
TEST_ENV = PYTHONDONTWRITEBYTECODE= WANDB_MODE=offline
TEST_WORKERS ?= 2
test: venv
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=25 tests $(ARGS)

# The tests that start no worker process (pyproject.toml's `multiprocess` marker).
test-fast: venv
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not multiprocess" tests $(ARGS)

# ruff (settings in pyproject.toml). `make format` rewrites files; `make lint` only checks.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff format .

clean:
	rm -rf outputs multirun parity plans .pytest_cache

# `make plan ARGS="model=llama3_8b precision=bf16 cluster=h100_sxm cluster.nodes=4"` predicts
# memory and step time of every layout (docs/planner.md).
plan: venv
	$(PY) -m hsdp_runner.plan $(ARGS)
