# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install the package with its dev extras; torch is pinned by
# constraints.txt so that CPU machines take the local CPU wheel instead of the CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean docs-picture

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	rm -rf outputs/demo
	$(BIN)/python recipes/train.py trainer.max_steps=30 hydra.run.dir=outputs/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) outputs multirun lightning_logs

# docs/demo_plan.png is the picture the demo's planning draws (outputs/docs-picture is a dry run of
# `make demo`: the same plan, without training); tests/docs checks that it is current.
docs-picture: $(STAMP)
	rm -rf outputs/docs-picture
	$(BIN)/python recipes/train.py trainer.max_steps=30 dry_run=true hydra.run.dir=outputs/docs-picture
	cp outputs/docs-picture/plan.png docs/demo_plan.png
