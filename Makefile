# Distributed LLM Training, hands-on
#   make setup      create .venv and install the course (tested CPU torch pinned)
#   make lab        setup, then open JupyterLab on the course
#   make test       setup, then the whole suite: pytest on tests/, nbval on course/ and solutions/
#   make labs       regenerate labs/ from solutions/
#   make notebooks  re-execute course/ and solutions/ in place (outputs are committed)
#   make bench      run the benchmarks and print their tables

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The tested torch. On a CPU-only machine this is a CPU build; an unpinned
# torch pulls a multi-GB CUDA build. GPU users: see README, "On a GPU node".
TORCH  ?= torch==2.13.0

.PHONY: setup lab test labs notebooks bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[lab,dev]"
	touch $(STAMP)

lab: setup
	$(BIN)/jupyter lab course/

test: setup
	$(BIN)/python -m pytest tests course solutions --nbval-lax --nbval-current-env -p no:cacheprovider

labs: setup
	$(BIN)/python tools/nbtool.py labs

notebooks: setup
	$(BIN)/python tools/nbtool.py run

bench: setup
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
