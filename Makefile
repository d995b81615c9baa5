# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install the package with its dev extras; torch is pinned by
# constraints.txt so that CPU machines take the local CPU wheel instead of the CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-timing test-oldest install clean docs-picture gpu-wheels

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	rm -rf outputs/demo
	$(BIN)/python recipes/train.py cluster=cpu_demo trainer.max_steps=30 hydra.run.dir=outputs/demo

# The suite runs on TEST_WORKERS pytest-xdist workers: about half of a serial run's time is spent
# waiting (ranks starting, commands importing torch and Lightning, signals' grace periods), so two
# workers on two cores took 1,383 s where one process took 2,032 s (same clone, same host, one after
# the other; 3094 tests). Waits and pytest timeouts are
# scaled by the host's load (tests/slow_host.py). TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist worksteal

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not timing" --durations=30 $(XDIST)

# The fast lane while editing: the tests that start no process (multi-process tests are marked
# slow; under HEXISCALE_FAST_LANE=1 an unmarked test that starts one fails and says so).
test-fast: $(STAMP)
	HEXISCALE_FAST_LANE=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow and not timing" --durations=10 $(XDIST)

# Tests that assert the host's timings (the emulated cluster's FLOP/s ratios, latency): meaningful on
# a quiet host only, as the benchmarks that rely on them check the same before measuring.
test-timing: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m timing

# The floors of pyproject.toml: the oldest torch and Lightning (constraints-oldest.txt) in a venv of
# their own, then the distributed suites (OLDEST_TESTS) on them. PyPI's torch wheel of that version
# brings its CUDA libraries (about 5 GB in the venv).
OLDEST_VENV ?= .venv-oldest
OLDEST_TESTS ?= tests/runtime tests/lightning

test-oldest:
	test -x $(OLDEST_VENV)/bin/python || $(PY) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet -c constraints-oldest.txt torch
	$(OLDEST_VENV)/bin/python -m pip install --quiet -c constraints-oldest.txt -e ".[dev]"
	$(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(OLDEST_TESTS)

clean:
	rm -rf $(VENV) .venv-oldest outputs multirun lightning_logs

# docs/demo_plan.png is the picture the demo's planning draws (outputs/docs-picture is a dry run of
# `make demo`: the same plan, without training); tests/docs checks that it is current.
docs-picture: $(STAMP)
	rm -rf outputs/docs-picture
	$(BIN)/python recipes/train.py cluster=cpu_demo trainer.max_steps=30 dry_run=true hydra.run.dir=outputs/docs-picture
	cp outputs/docs-picture/plan.png docs/demo_plan.png

# The wheels a lent GPU machine lacks (its image has torch and Lightning, not these; it reaches no
# index), for its Python 3.12, into .whl/, which benchmarks/gpu_session.sh installs there. antlr4's
# runtime is published as a source archive only: built here into a pure-Python wheel.
GPU_PY ?= 3.12
GPU_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir .whl
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
		$(GPU_PLATFORMS) -d .whl omegaconf==2.3.0 hydra-core==1.3.2 pymetis==2025.2.2
	$(BIN)/python -m pip wheel --quiet --no-deps -w .whl antlr4-python3-runtime==4.9.3
