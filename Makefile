# Distributed LLM Training, hands-on
#   make setup      create .venv and install the course (tested CPU torch pinned)
#   make lab        setup, then open JupyterLab on the repository at START_HERE.ipynb
#   make my-copy    copy labs and course notebooks to work/ (yours, ignored by git)
#   make reset      throw away your changes to the repository's notebooks
#   make normalize  file names, notebook metadata, START_HERE.ipynb (after adding a chapter)
#   make test-browser  a real-browser smoke test (needs chromium and playwright)
#   make test       setup, then the whole suite: pytest on tests/, nbval on course/ and solutions/
#                   (not the browser test: it runs only where chromium is, by make test-browser)
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

# JupyterLab rooted at the repository (course/, labs/, solutions/ and helpers/ all
# reachable), opening the landing page. tests/test_browser.py starts it the same way.
LAB_ARGS := --ServerApp.root_dir=$(CURDIR) START_HERE.ipynb

.PHONY: setup lab test labs notebooks bench clean my-copy reset normalize test-browser

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[lab,dev]"
	touch $(STAMP)

lab: setup
	$(BIN)/jupyter lab $(LAB_ARGS)

# Copies never overwrite: run again after `git pull` to get new chapters only.
my-copy:
	mkdir -p work
	@for f in labs/*.ipynb course/*.ipynb; do \
	  if [ -e "work/$$(basename $$f)" ]; then echo "kept   work/$$(basename $$f)"; \
	  else cp "$$f" work/ && echo "copied work/$$(basename $$f)"; fi; done
	@echo "your copies are in work/ (git ignores it); open them from JupyterLab's file browser"

reset:
	git checkout -- course labs solutions START_HERE.ipynb

normalize: setup
	$(BIN)/python tools/nbtool.py normalize

# Needs Chromium from the system (Debian/Ubuntu: sudo apt-get install chromium).
test-browser: setup
	$(BIN)/python -m pip install -q -e ".[browser]"
	$(BIN)/python -m pytest tests/test_browser.py -p no:cacheprovider -v -rs

test: setup
	$(BIN)/python -m pytest tests course solutions -m "not browser" --nbval-lax --nbval-current-env -p no:cacheprovider --durations=40

labs: setup
	$(BIN)/python tools/nbtool.py labs

notebooks: setup
	$(BIN)/python tools/nbtool.py run

bench: setup
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
