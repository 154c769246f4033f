# Two commands for a fresh machine: `make run` (install, then the default job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed-test
# `make test-oldest`: the oldest versions pyproject.toml declares, pinned in ci/oldest.txt.
OLDEST ?= .venv-oldest
OLDEST_STAMP := $(OLDEST)/.installed-oldest
# `make test-newest`: the newest versions pip resolves today on the newest Python the ranges allow,
# with any pip constraint of the machine lifted (PIP_CONSTRAINT=/dev/null: an empty value leaves a
# pip.conf constraint in force), as a user's `pip install -U` would.
# The first Python 3.13 that runs: on PATH, else pyenv's (its shim is on PATH without running
# unless 3.13 is among pyenv's chosen versions).
NEWEST_PYTHON ?= $(firstword $(shell for p in python3.13 $$HOME/.pyenv/versions/3.13*/bin/python3.13; do \
	"$$p" -c "" >/dev/null 2>&1 && echo "$$p"; done))
NEWEST ?= .venv-newest
NEWEST_STAMP := $(NEWEST)/.installed-newest
# CPU-only machine: `make run TORCH_INDEX=https://download.pytorch.org/whl/cpu` installs the CPU
# torch wheel first (PyPI's default torch on Linux is the CUDA build, several GB).
TORCH_INDEX ?=
# pytest-xdist: the suite in WORKERS processes (CI's machine has 2 cores; `make test WORKERS=auto`
# takes one per core), a test module per worker at a time (--dist loadfile: the module-scoped
# fixtures, tiny models trained or saved once, are built once).
WORKERS ?= 2
XDIST = -n $(WORKERS) --dist loadfile

.PHONY: run test test-fast test-oldest test-newest torch-note docs lint format bench clean
# The docs site (mkdocs.yml): built strictly, offline; `make test` builds it into a temporary folder.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Said before a first install on a machine without an NVIDIA GPU (no nvidia-smi) when TORCH_INDEX is
# not set and the venv has no torch yet: PyPI's torch there is still the CUDA build (issue 38).
CPU_TORCH_NOTE = if [ -z "$(TORCH_INDEX)" ] && ! command -v nvidia-smi >/dev/null 2>&1 \
	&& ! $(BIN)/python -c "import torch" >/dev/null 2>&1; then \
	echo "isotui: no NVIDIA GPU here (no nvidia-smi), yet PyPI's torch is the CUDA build (several GB);"; \
	echo "isotui: for the CPU wheel, stop now (Ctrl-C) and run: make $(or $(MAKECMDGOALS),run) TORCH_INDEX=https://download.pytorch.org/whl/cpu"; fi

torch-note: | $(BIN)/python
	@$(CPU_TORCH_NOTE)

# `make run` installs what running needs; `make test` adds the test extras (pytest, ruff...).
$(RUN_STAMP): pyproject.toml | $(BIN)/python torch-note
	$(if $(TORCH_INDEX),$(BIN)/pip install torch --index-url $(TORCH_INDEX))
	$(BIN)/pip install -e .
	touch $(RUN_STAMP)

$(STAMP): pyproject.toml | $(BIN)/python torch-note
	$(if $(TORCH_INDEX),$(BIN)/pip install torch --index-url $(TORCH_INDEX))
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP) $(RUN_STAMP)

$(OLDEST_STAMP): ci/oldest.txt pyproject.toml
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install -r ci/oldest.txt
	$(OLDEST)/bin/pip install --no-deps -e .
	touch $(OLDEST_STAMP)

$(NEWEST_STAMP): pyproject.toml
	@"$(NEWEST_PYTHON)" -c "" >/dev/null 2>&1 || { echo "make test-newest: no Python 3.13 found (give NEWEST_PYTHON=...)"; exit 2; }
	$(NEWEST_PYTHON) -m venv $(NEWEST)
	PIP_CONSTRAINT=/dev/null $(NEWEST)/bin/pip install -q -U -e '.[test]'
	touch $(NEWEST_STAMP)

run: $(RUN_STAMP)
	$(BIN)/isotui run sample_configs/minilm_builtin.toml --csv results/minilm_builtin.csv

test: $(STAMP)
	$(BIN)/ruff check isotui tests benchmarks scripts
	$(BIN)/ruff format --check isotui tests benchmarks scripts
	$(BIN)/lint-imports
	$(BIN)/mypy
	site=$$(mktemp -d) && $(MKDOCS) --site-dir $$site; status=$$?; rm -rf $$site; exit $$status
	$(BIN)/python -m pytest -q $(XDIST)

# The inner loop: every metric and the API, without the tests marked slow (the CLI and the app in
# subprocesses, the documented commands, long model runs).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow"

# The suite on the oldest declared versions, less the screen snapshots (taken with the test
# extra's Textual) and the type checker's own test (mypy is a tool, not a dependency).
test-oldest: $(OLDEST_STAMP)
	$(OLDEST)/bin/python -m pytest -q $(XDIST) --ignore=tests/test_snapshots.py --ignore=tests/test_typecheck.py

# The inner loop on the newest versions and Python (CI's third job): what `make test-fast` runs.
test-newest: $(NEWEST_STAMP)
	$(NEWEST)/bin/python -m pip list --format=freeze | grep -iE '^(torch|transformers|numpy|scipy|textual|accelerate)=='
	$(NEWEST)/bin/python -m pytest -q $(XDIST) -m "not slow"

docs: $(STAMP)
	$(MKDOCS) --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check isotui tests benchmarks scripts

format: $(STAMP)
	$(BIN)/ruff format isotui tests benchmarks scripts
	$(BIN)/ruff check --fix isotui tests benchmarks scripts

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/process.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/media.py
	$(BIN)/python benchmarks/attention.py

clean:
	rm -rf $(VENV) $(OLDEST) $(NEWEST) results site
