# Distributed LLM Training, hands-on
#   make setup      create .venv and install the course: the tested torch and the tested
#                   set of every other package (constraints.txt). Linux without a GPU:
#                   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
#                   (PyTorch's CPU build; PyPI's torch for Linux is the CUDA build, GBs)
#   make lab        setup, then open JupyterLab on the repository at START_HERE.ipynb
#                   (at work/START_HERE.ipynb, your copies, once make my-copy made it)
#   make my-copy    copy course and lab notebooks to work/course, work/labs (yours,
#                   ignored by git) with work/START_HERE.ipynb linking them
#   make reset      throw away your changes to the repository's notebooks
#   make normalize  file names, notebook metadata, START_HERE.ipynb (after adding a chapter)
#   make test-browser  a real-browser smoke test (needs chromium and playwright)
#   make test       setup, then the whole suite: pytest on tests/ (three workers, TEST_WORKERS),
#                   then nbval on course/ and solutions/ one notebook at a time,
#                   every launch under NCCL's rules (COURSE_NCCL_RULES=1, README)
#                   (not the browser test: it runs only where chromium is, by make test-browser)
#   make test-newest   the whole suite in .venv-newest, on today's newest releases of
#                   everything (torch too: TORCH_NEWEST), to find out when the world moves
#   make lock       write constraints.txt from .venv (LOCK_FROM=.venv-newest to adopt the
#                   newest set after make test-newest passed)
#   make test-gpu   on a GPU node, with the node's own torch (GPU_PYTHON): the CUDA tests,
#                   the suite as CI runs it (CUDA hidden), then the notebooks and lab
#                   checks on nccl where a launch has a GPU per rank (a table says which)
#   make labs       regenerate labs/ from solutions/
#   make notebooks  re-execute course/ and solutions/ in place (outputs are committed)
#   make bench      run the benchmarks and print their tables
#   make site       the course as a static site in _build/site (from the committed outputs)
#   make check-labs DIR=work [JOBS=4] [ARGS="--only ^0[1-3]_ --exercise-timeout 60"]
#                   run every lab exercise's check in DIR (one learner's folder, or one
#                   subfolder per learner): a pass/fail table and DIR/check_labs.csv;
#                   ARGS: any other option of tools/check_labs.py (its --help)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The tested torch. From PyPI this is the CPU build on macOS and the CUDA build
# (several GB) on Linux x86_64; TORCH_INDEX picks another index for torch alone,
# e.g. PyTorch's CPU wheels: make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Left empty, pip uses its own configuration (a wheel already on disk, offline).
# GPU users: see README, "On a GPU node".
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=

# JupyterLab rooted at the repository (course/, labs/, solutions/ and helpers/ all
# reachable), opening the landing page. tests/test_browser.py starts it the same way.
LAB_ARGS := --ServerApp.root_dir=$(CURDIR) \
            $(if $(wildcard work/START_HERE.ipynb),work/START_HERE.ipynb,START_HERE.ipynb)

# The tested set of every package but torch (torch is pinned by TORCH above, since
# an instructor's node brings its own CUDA build). It was resolved on one Python
# version (its first line says which); on another, setup installs unpinned.
CONSTRAINTS ?= constraints.txt
# The optional groups setup installs (pyproject.toml); .ci/run adds site in the same call.
EXTRAS ?= lab,dev
# What make test-newest installs as torch: the newest release by default.
TORCH_NEWEST ?= torch
NEWEST := .venv-newest
LOCK_FROM ?= $(VENV)
# On a GPU node: the Python that has the node's torch and the course (pip install -e .[lab,dev]).
GPU_PYTHON ?= python3
# The suite, as CI runs it (the browser test has its own target), in two parts:
# tests/ on TEST_WORKERS pytest-xdist workers, a test file per worker (--dist loadfile:
# a file's tests keep their order and their module fixtures, the site build among them);
# then the notebooks one at a time, with nothing beside them, so that the times they
# print and the per-notebook durations are a quiet machine's. Three workers on two
# cores: many tests wait (a timeout that must expire, a hang that must be named), and a
# third worker keeps the cores busy meanwhile (measured: cores 80 % busy with two
# workers, 92 % with three; 339 s -> 294 s on a 2-core AMD EPYC). The notebooks' kernels
# get their rank servers from one zygote (conftest.py, helpers/launch/zygote.py).
TEST_WORKERS ?= 3
SUITE_TESTS := tests -m "not browser" -p no:cacheprovider --durations=30 \
               -n $(TEST_WORKERS) --dist loadfile
SUITE_NOTEBOOKS := course solutions --nbval-lax --nbval-current-env -p no:cacheprovider \
                   --durations=42
# Both parts run even when the first fails; the exit status is the first failure's.
SUITE = $(1) -m pytest $(SUITE_TESTS); status=$$?; \
        $(1) -m pytest $(SUITE_NOTEBOOKS) && exit $$status

.PHONY: setup lab lab-args test labs notebooks bench clean my-copy reset normalize test-browser \
        test-newest lock test-gpu site check-labs

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if [ -z "$(TORCH_INDEX)" ] && [ "$$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null \
	   && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  echo "note: no GPU here, and on Linux PyPI's $(TORCH) is the CUDA build (several GB)."; \
	  echo "      For PyTorch's CPU build: make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu"; fi
	$(BIN)/python -m pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]" $$($(BIN)/python tools/lock.py pip-args $(CONSTRAINTS))
	touch $(STAMP)

test-newest:
	test -x $(NEWEST)/bin/python || $(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	$(NEWEST)/bin/python -m pip install -q --upgrade $(TORCH_NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[lab,dev]"
	$(NEWEST)/bin/python tools/lock.py versions
	export COURSE_NCCL_RULES=1; $(call SUITE,$(NEWEST)/bin/python)

lock:
	$(LOCK_FROM)/bin/python tools/lock.py write $(CONSTRAINTS)

# The same on one GPU and on eight: (1) the CUDA tests; (2) the suite exactly as CI runs
# it, CUDA hidden (gloo on CPU under NCCL's rules); (3) every notebook and every lab check
# with the solutions' answers, GPUs visible: a launch of n ranks runs on nccl where the
# node has n GPUs (2, 3, 4, 8 ...), else on gloo, and a table says which ran where.
GPU_LOG ?= $(CURDIR)/tmp/test-gpu-launches.log
test-gpu:
	$(GPU_PYTHON) tools/lock.py versions
	$(GPU_PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu needs CUDA: this Python sees no GPU (GPU_PYTHON=$(GPU_PYTHON))')"
	@$(GPU_PYTHON) -c "import torch; print(f'== {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}')"
	@echo "== 1/3 the CUDA tests (pytest -m gpu)"
	$(GPU_PYTHON) -m pytest tests -m gpu -v -rs -p no:cacheprovider
	@echo "== 2/3 the suite as CI runs it: CUDA hidden, gloo on the CPU, NCCL's rules on"
	export CUDA_VISIBLE_DEVICES= COURSE_NCCL_RULES=1; $(call SUITE,$(GPU_PYTHON))
	@echo "== 3/3 the notebooks and the lab checks on the GPUs (nccl where a launch has a GPU per rank)"
	mkdir -p $(dir $(GPU_LOG)) && rm -f $(GPU_LOG)
	COURSE_LAUNCH_LOG=$(GPU_LOG) $(GPU_PYTHON) -m pytest course solutions tests/test_checks_*.py \
	    -k "ipynb or test_passes" -m "not gloo_only" --nbval-lax --nbval-current-env -p no:cacheprovider
	$(GPU_PYTHON) tools/launch_log.py $(GPU_LOG)

lab: setup
	$(BIN)/jupyter lab $(LAB_ARGS)

# What make lab passes to JupyterLab (tests/test_browser.py starts it the same way).
lab-args:
	@echo $(LAB_ARGS)

# Copies never overwrite: run again after `git pull` to get new chapters only.
my-copy: setup
	$(BIN)/python tools/nbtool.py my-copy work

reset:
	git checkout -- course labs solutions START_HERE.ipynb

normalize: setup
	$(BIN)/python tools/nbtool.py normalize

# Needs Chromium from the system (Debian/Ubuntu: sudo apt-get install chromium).
test-browser: setup
	$(BIN)/python -m pip install -q -e ".[browser]"
	$(BIN)/python -m pip install -q -e ".[site]" $$($(BIN)/python tools/lock.py pip-args $(CONSTRAINTS))
	$(BIN)/python -m pytest tests/test_browser.py tests/test_site.py -m browser -p no:cacheprovider -v -rs

# Under NCCL's rules (helpers/launch/nccl_rules.py): a hang or an error that a GPU
# node would show appears here too. A learner's own runs are plain gloo.
test: setup
	$(BIN)/python tools/lock.py versions
	export COURSE_NCCL_RULES=1; $(call SUITE,$(BIN)/python)

labs: setup
	$(BIN)/python tools/nbtool.py labs

notebooks: setup
	$(BIN)/python tools/nbtool.py run

# Each benchmark's seconds and the total are printed: the whole set is meant to end within
# 10 minutes on a 2-core laptop (CPU-sized problems without a GPU: benchmarks/_args.py).
bench: setup
	@all=$$(date +%s); for b in benchmarks/bench_*.py; do echo "== $$b"; t=$$(date +%s); \
	  $(BIN)/python $$b || exit 1; echo "== $$b: $$(( $$(date +%s) - t )) s"; done; \
	  echo "== make bench: $$(( $$(date +%s) - all )) s"

# The site group installs into the course's .venv, pinned like the rest (constraints.txt),
# once: a stamp records it, so a later make site only builds (pip again when
# pyproject.toml or the constraints change, as for setup).
SITE_STAMP := $(VENV)/.installed-site

$(SITE_STAMP): $(STAMP) pyproject.toml $(CONSTRAINTS)
	$(BIN)/python -m pip install -q -e ".[site]" $$($(BIN)/python tools/lock.py pip-args $(CONSTRAINTS))
	touch $(SITE_STAMP)

site: setup $(SITE_STAMP)
	$(BIN)/python tools/site/build.py

DIR ?= work
JOBS ?= 1
ARGS ?=
check-labs: setup
	$(BIN)/python tools/check_labs.py $(DIR) --jobs $(JOBS) $(ARGS)

clean:
	rm -rf $(VENV) $(NEWEST) .pytest_cache
