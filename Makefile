# The two commands of the README: `make run` (set up, then the main job on the embedded default) and `make test` (the
# full suite, what CI runs); `make test-fast` is the quick loop while changing code (no `slow` tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export DVC_NO_ANALYTICS := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: setup run test test-fast repro pipelines

# The packages go in with uv's pip interface (pip only installs uv): the same resolution of pyproject.toml, in ~40 s
# instead of pip's ~110 s on 2 cores (docs/timings.md); --compile-bytecode, as pip does by default. uv reads no
# pip.conf: behind a package mirror set UV_DEFAULT_INDEX (a PIP_INDEX_URL in the environment is passed on). Where uv
# cannot be installed or cannot install (no wheel for the platform, no writable cache), pip installs the same, saying so.
UV := $(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode
ifdef PIP_INDEX_URL
export UV_DEFAULT_INDEX ?= $(PIP_INDEX_URL)
endif
INSTALL = { $(BIN)/python -m pip install --quiet 'uv>=0.9' && $(UV) $(1); } || \
	{ echo "make setup: uv failed (above); pip installs $(1) instead." >&2; $(BIN)/python -m pip install --quiet $(1); }

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(call INSTALL,-e '.[dev]')
# hpsv2x (hpsv2 with its BPE vocabulary): test-only reference of tests/test_hps_reference.py. --no-deps because it
# pins pytest==7.2.0 and protobuf<4, which our stack cannot take; the test does without its other dependencies.
	$(call INSTALL,--no-deps hpsv2x==1.2.0)
# The project's own modules compiled to bytecode once, as pip compiles the packages it installs (an editable install's
# are not): where PYTHONDONTWRITEBYTECODE is set, as on this project's machines, every process compiled them again
# (~0.25 s of CPU for a stage's imports).
	$(BIN)/python -m compileall -q jagg_core tasks flows > /dev/null
	touch $@

setup: $(VENV)/.installed

# Two training runs at a time, one torch thread each (the toy profile's resources.num_threads).
run: setup
	$(BIN)/jagg run --profile toy --parallel-runs 2

# The suite runs in $(TEST_WORKERS) worker processes (pytest-xdist), each test file in one worker (its module
# fixtures built once), torch single-threaded in each; one worker more than the machine has cores, since the
# end-to-end tests spend much of their time waiting on servers and on fresh processes' start-up. Files go out
# longest first (tests/conftest.py's LONGEST_FIRST, in collection order: --no-loadscope-reorder).
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# lint-imports first: the import contracts of pyproject.toml (the floors of docs/architecture.md), in seconds.
test: setup
	$(BIN)/lint-imports
	$(PYTEST)

test-fast: setup
	$(BIN)/lint-imports
	$(PYTEST) -m "not slow"

# DVC reproduces one profile's pipeline: params.yaml's `profile` key (toy) unless given (`make repro PROFILE=toy-full`).
# The active profile's (that key's) is the repository's dvc.yaml, so `make repro` is a bare `dvc repro`; every other
# one's is pipelines/$(PROFILE)/dvc.yaml. `make pipelines` writes every profile's pipeline from pipelines/template.yaml
# and params.yaml (and, after `profile` changed, moves the root one and its dvc.lock); `make repro` first checks that
# they are up to date (a profile whose overlay gained a run key, a `profile` changed).
ACTIVE := $(or $(shell sed -n 's/^profile:[[:space:]]*\([a-z0-9_.-]*\).*/\1/p' params.yaml),toy)
PROFILE ?= $(ACTIVE)
PIPELINE = $(if $(filter-out $(ACTIVE),$(PROFILE)),pipelines/$(PROFILE)/dvc.yaml)

pipelines: setup
	$(BIN)/python -m tasks.dvc_pipelines

repro: setup
	$(BIN)/python -m tasks.dvc_pipelines --check
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro $(PIPELINE)
