# Two commands for a fresh machine: `make run` (install, then the default job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint format bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/isotui run sample_configs/minilm_builtin.toml --csv results/minilm_builtin.csv

test: $(STAMP)
	$(BIN)/ruff check isotui tests benchmarks scripts
	$(BIN)/ruff format --check isotui tests benchmarks scripts
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check isotui tests benchmarks scripts

format: $(STAMP)
	$(BIN)/ruff format isotui tests benchmarks scripts
	$(BIN)/ruff check --fix isotui tests benchmarks scripts

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/media.py
	$(BIN)/python benchmarks/attention.py

clean:
	rm -rf $(VENV) results
