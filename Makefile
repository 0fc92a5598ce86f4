# Nyströmformer pipeline. `make help` lists the targets; variables can be set on the command line,
# e.g. `make pretrain MODEL=nystrom-4096` or `make data-512 WIKI_DUMP=~/dumps/enwiki-latest-pages-articles.xml.bz2`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NYS := $(VENV)/bin/nystromformer

# Data (see data-preprocessing/README.md)
WIKI_DUMP ?= downloads/enwiki-latest-pages-articles.xml.bz2
BOOKCORPUS ?= downloads/bookcorpus
STORIES ?= downloads/stories
REALNEWS ?= downloads/realnews/realnews.jsonl
# BookCorpus as one .txt file per book (not books_large_p*.txt): BOOKCORPUS_FLAGS=--document-per-file
BOOKCORPUS_FLAGS ?=
TOKENIZER ?= roberta-base
WORK ?= data-preprocessing/work
PARTITIONS := $(WORK)/partitions
# The corpora to use (e.g. CORPORA=wiki with only a Wikipedia dump), with the paper's sampling ratios
CORPORA ?= wiki bookcorpus stories realnews
RATIO_wiki := 1
RATIO_bookcorpus := 1
RATIO_stories := 0.333
RATIO_realnews := 0.333
DATASETS ?= $(foreach c,$(CORPORA),$(PARTITIONS)/$(c):$(RATIO_$(c)))
KNOWN_CORPORA := wiki bookcorpus stories realnews
# The variable naming each corpus's input (checked before the first corpus step: no hours of Wikipedia first)
INPUT_VAR_wiki := WIKI_DUMP
INPUT_VAR_bookcorpus := BOOKCORPUS
INPUT_VAR_stories := STORIES
INPUT_VAR_realnews := REALNEWS
ifneq ($(filter partitions data-512 data-4096,$(MAKECMDGOALS)),)
ifeq ($(strip $(CORPORA)),)
$(error CORPORA is empty: give some of $(KNOWN_CORPORA))
endif
ifneq ($(filter-out $(KNOWN_CORPORA),$(CORPORA)),)
$(error CORPORA: unknown corpus $(filter-out $(KNOWN_CORPORA),$(CORPORA)) (known: $(KNOWN_CORPORA)))
endif
endif
# Dev split: runs of this many × 510 tokens of text, at every --seq-len (8,192 sequences of 512, as the paper's
# files held; the same text at 4096, so no length's dev text is another's training text); small data needs fewer
DEV_RUN ?= 8192

# Training
MODEL ?= nystrom-512
CHECKPOINT ?= 99
TASK ?= SST-2
# GLUE tasks for glue-sweep: all, or comma-separated names (RTE,MRPC,STS-B)
TASKS ?= all
BATCH_SIZE ?= 32
LR ?= 2e-5
EPOCHS ?= 5
# glue-sweep's grid (the paper's)
LRS ?= 2e-5,3e-5,4e-5,5e-5
BATCH_SIZES ?= 16,32
NPROC ?= 1
# torchrun's rendezvous flags; the default runs on this machine only
TORCHRUN_ARGS ?= --standalone
# More `docker run` flags for docker-pretrain, e.g. with rootful Docker, files owned by you rather than root:
# make docker-pretrain DOCKER_RUN_ARGS="--user $(id -u):$(id -g) -e HOME=/tmp"  (the shell fills in the ids)
DOCKER_RUN_ARGS ?=
IMAGE ?= nystromformer:latest

.DEFAULT_GOAL := help
.PHONY: help setup constraints test demo partitions clean-partitions data-512 data-4096
.PHONY: pretrain validate glue glue-sweep docker-build docker-pretrain check-inputs

# A variable of another target given on the command line would be silently unused: $(call only_for,VARS,TARGET,USE)
only_for = $(foreach v,$(1),$(if $(filter command line,$(origin $(v))),@echo "error: $(v) is not used by $(2) \
  (it takes $(3))" >&2; exit 2;))
# The model folder, for the targets that run outside our command-line checks (torchrun, docker)
require_model = @[ -f "$(MODEL)/config.json" ] || { echo "error: MODEL=$(MODEL): no config.json in that folder" >&2; \
  exit 2; }

help: ## list the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | awk -F'\t' '{printf "  %-16s %s\n", $$1, $$2}'

setup: $(VENV)/.installed ## create .venv and install the project with its test tools

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' -c constraints.txt
	touch $@

# Re-resolve: the newest releases within pyproject.toml's ranges, in a scratch venv, pinned into constraints.txt.
constraints: ## re-pin constraints.txt to the newest releases pyproject.toml allows (then: make test)
	rm -rf .venv-resolve && $(PYTHON) -m venv .venv-resolve
	.venv-resolve/bin/python -m pip install -q -e '.[test]'
	{ sed -n '/^#/p' constraints.txt; .venv-resolve/bin/python -m pip freeze --exclude-editable \
	  | sed 's/^torch==\(.*\)+cpu$$/torch==\1/'; } > constraints.txt.new && mv constraints.txt.new constraints.txt
	rm -rf .venv-resolve

test: setup ## run the test suite (GPU tests skip on CPU)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests ran"; rc=0; fi; exit $$rc

demo: setup ## the whole pipeline on the embedded sample in demo/ (writes demo-output/)
	OMP_NUM_THREADS=1 $(NYS) demo --output demo-output

# Corpora (WIKI_DUMP BOOKCORPUS STORIES REALNEWS) → partitions. Each step leaves a stamp in $(WORK)/completed when
# it has finished, so data-4096 after data-512 (or a rerun after a failure) skips what is done; delete a stamp (or
# `make clean-partitions`) to redo a step, e.g. after new downloads.
EXTRACTED := $(WORK)/wiki-extracted
STAMPS := $(WORK)/completed
partitions: $(addprefix $(STAMPS)/,$(CORPORA)) ## extract and partition the corpora (CORPORA: default all four)

check-inputs:
	@$(foreach c,$(CORPORA),[ -e "$(STAMPS)/$(c)" ] $(if $(filter wiki,$(c)),|| [ -e "$(STAMPS)/wiki-extracted" ]) \
	  || [ -e "$($(INPUT_VAR_$(c)))" ] || { echo "error: $(INPUT_VAR_$(c))=$($(INPUT_VAR_$(c))): not found (the \
	  $(c) input; set $(INPUT_VAR_$(c)), or leave $(c) out of CORPORA)" >&2; exit 2; };) true

$(STAMPS)/wiki-extracted: | $(VENV)/.installed check-inputs
	$(NYS) extract-wiki --dump $(WIKI_DUMP) --output $(EXTRACTED) --overwrite
	mkdir -p $(STAMPS) && touch $@
$(STAMPS)/wiki: $(STAMPS)/wiki-extracted
	$(NYS) preprocess wiki --input $(EXTRACTED) --output $(PARTITIONS)/wiki
	mkdir -p $(STAMPS) && touch $@
$(STAMPS)/bookcorpus: | $(VENV)/.installed check-inputs
	$(NYS) preprocess bookcorpus --input $(BOOKCORPUS) --output $(PARTITIONS)/bookcorpus $(BOOKCORPUS_FLAGS)
	mkdir -p $(STAMPS) && touch $@
$(STAMPS)/stories: | $(VENV)/.installed check-inputs
	$(NYS) preprocess stories --input $(STORIES) --output $(PARTITIONS)/stories
	mkdir -p $(STAMPS) && touch $@
$(STAMPS)/realnews: | $(VENV)/.installed check-inputs
	$(NYS) preprocess realnews --input $(REALNEWS) --output $(PARTITIONS)/realnews
	mkdir -p $(STAMPS) && touch $@

clean-partitions: ## forget finished corpus steps (the next data-512/data-4096 redoes them)
	rm -rf $(STAMPS)

# build-shards itself resumes and skips finished partition files
data-512: partitions ## shards of 512 tokens in data-preprocessing/512-roberta (TOKENIZER=folder)
	$(NYS) build-shards --seq-len 512 --tokenizer $(TOKENIZER) --dev-run $(DEV_RUN) --output data-preprocessing/512-roberta $(DATASETS)

data-4096: partitions ## shards of 4096 tokens in data-preprocessing/4096-roberta (reuses the partitions)
	$(NYS) build-shards --seq-len 4096 --tokenizer $(TOKENIZER) --dev-run $(DEV_RUN) --output data-preprocessing/4096-roberta $(DATASETS)

# One process on one machine: no torchrun (whose own traceback on Ctrl-C would look like a crash; the run stops
# cleanly anyway)
pretrain: setup ## pretrain MODEL (resumes; NPROC=8 for 8 GPUs; multi-node: TORCHRUN_ARGS="--nnodes ...")
ifeq ($(NPROC) $(TORCHRUN_ARGS),1 --standalone)
	$(NYS) pretrain --model-dir $(MODEL)
else
	@[[ "$(NPROC)" =~ ^[1-9][0-9]*$$ ]] || { echo "error: NPROC=$(NPROC): a number of processes, from 1" >&2; exit 2; }
	$(require_model)
	$(VENV)/bin/torchrun $(TORCHRUN_ARGS) --nproc_per_node $(NPROC) code/run_pretrain.py --model-dir $(MODEL)
endif

validate: setup ## MLM validation of MODEL's checkpoints not yet validated (CHECKPOINT=N: that one)
	$(NYS) validate --model-dir $(MODEL) $(if $(filter command line,$(origin CHECKPOINT)),--checkpoint $(CHECKPOINT))

glue: setup ## fine-tune MODEL's cp-CHECKPOINT on TASK (BATCH_SIZE, LR, EPOCHS)
	$(call only_for,TASKS LRS BATCH_SIZES,glue,TASK LR BATCH_SIZE; TASKS LRS BATCH_SIZES are glue-sweep's)
	$(NYS) glue --model-dir $(MODEL) --task $(TASK) --checkpoint $(CHECKPOINT) --batch_size $(BATCH_SIZE) --lr $(LR) --epoch $(EPOCHS)

glue-sweep: setup ## the paper's GLUE grid (LRS x BATCH_SIZES, EPOCHS) for TASKS on MODEL's cp-CHECKPOINT
	$(call only_for,TASK LR BATCH_SIZE,glue-sweep,TASKS LRS BATCH_SIZES; TASK LR BATCH_SIZE are glue's)
	$(NYS) glue-sweep --model-dir $(MODEL) --checkpoint $(CHECKPOINT) --tasks $(TASKS) --lrs $(LRS) --batch-sizes $(BATCH_SIZES) --epoch $(EPOCHS)

docker-build: ## build the Docker image IMAGE from docker/Dockerfile
	docker build -f docker/Dockerfile -t $(IMAGE) .

# The whole repository is mounted, so that paths relative to the model folder (data, glue, a from_cp in
# ../nystrom-512) resolve as outside the container.
docker-pretrain: ## pretrain MODEL in Docker on all GPUs (stop with docker stop; rerun to resume)
	@case "$(MODEL)" in /*|../*) echo "error: MODEL=$(MODEL): a folder inside the repository (mounted at /workspace)" \
	  >&2; exit 2;; esac
	$(require_model)
	docker run --rm --init --gpus all --ipc=host --stop-timeout 120 \
	  --name nystromformer-$(notdir $(patsubst %/,%,$(MODEL))) $(DOCKER_RUN_ARGS) \
	  -v "$(CURDIR):/workspace" -w "/workspace/$(MODEL)" $(IMAGE) pretrain
