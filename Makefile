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

.PHONY: run test parity venv clean sweep compare plan

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

clean:
	rm -rf outputs multirun .pytest_cache

# `make plan ARGS="model=llama3_8b precision=bf16 cluster=h100_sxm cluster.nodes=4"` predicts
# memory and step time of every layout (README "Plan before you spend").
plan: venv
	$(PY) -m hsdp_runner.plan $(ARGS)
