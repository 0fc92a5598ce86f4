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
TOKENIZER ?= roberta-base
WORK ?= data-preprocessing/work
PARTITIONS := $(WORK)/partitions
DATASETS := $(PARTITIONS)/wiki:1 $(PARTITIONS)/bookcorpus:1 $(PARTITIONS)/stories:0.333 $(PARTITIONS)/realnews:0.333

# Training
MODEL ?= nystrom-512
CHECKPOINT ?= 99
TASK ?= SST-2
# GLUE tasks for glue-sweep: all, or comma-separated names (RTE,MRPC,STS-B)
TASKS ?= all
BATCH_SIZE ?= 32
LR ?= 3e-5
EPOCHS ?= 5
NPROC ?= 1
IMAGE ?= nystromformer:latest

.DEFAULT_GOAL := help
.PHONY: help setup test demo partitions data-512 data-4096 pretrain validate glue glue-sweep docker-build docker-pretrain

help: ## list the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | awk -F'\t' '{printf "  %-16s %s\n", $$1, $$2}'

setup: $(VENV)/.installed ## create .venv and install the project with its test tools

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: setup ## run the test suite (GPU tests skip on CPU)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests ran"; rc=0; fi; exit $$rc

demo: setup ## the whole pipeline on the embedded sample in demo/ (writes demo-output/)
	OMP_NUM_THREADS=1 $(NYS) demo --output demo-output

partitions: setup ## extract and partition the four corpora (paths: WIKI_DUMP BOOKCORPUS STORIES REALNEWS)
	$(NYS) extract-wiki --dump $(WIKI_DUMP) --output $(WORK)/wiki-extracted
	$(NYS) preprocess wiki --input $(WORK)/wiki-extracted --output $(PARTITIONS)/wiki
	$(NYS) preprocess bookcorpus --input $(BOOKCORPUS) --output $(PARTITIONS)/bookcorpus
	$(NYS) preprocess stories --input $(STORIES) --output $(PARTITIONS)/stories
	$(NYS) preprocess realnews --input $(REALNEWS) --output $(PARTITIONS)/realnews

data-512: partitions ## shards of 512 tokens in data-preprocessing/512-roberta (TOKENIZER=folder)
	$(NYS) build-shards --seq-len 512 --tokenizer $(TOKENIZER) --output data-preprocessing/512-roberta $(DATASETS)

data-4096: partitions ## shards of 4096 tokens in data-preprocessing/4096-roberta
	$(NYS) build-shards --seq-len 4096 --tokenizer $(TOKENIZER) --output data-preprocessing/4096-roberta $(DATASETS)

pretrain: setup ## pretrain MODEL (resumes; NPROC=8 for 8 GPUs via torchrun)
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) code/run_pretrain.py --model-dir $(MODEL)

validate: setup ## MLM validation of MODEL's checkpoints not yet validated
	$(NYS) validate --model-dir $(MODEL)

glue: setup ## fine-tune MODEL's cp-CHECKPOINT on TASK (BATCH_SIZE, LR, EPOCHS)
	$(NYS) glue --model-dir $(MODEL) --task $(TASK) --checkpoint $(CHECKPOINT) --batch_size $(BATCH_SIZE) --lr $(LR) --epoch $(EPOCHS)

glue-sweep: setup ## the paper's GLUE grid for TASKS on MODEL's cp-CHECKPOINT
	$(NYS) glue-sweep --model-dir $(MODEL) --checkpoint $(CHECKPOINT) --tasks $(TASKS)

docker-build: ## build the Docker image IMAGE from docker/Dockerfile
	docker build -f docker/Dockerfile -t $(IMAGE) .

docker-pretrain: ## pretrain MODEL in Docker on all GPUs (stop with docker stop; rerun to resume)
	docker run --rm --gpus all --ipc=host --stop-timeout 120 --name nystromformer-$(MODEL) \
	  -v $(CURDIR)/$(MODEL):/workspace/$(MODEL) \
	  -v $(CURDIR)/data-preprocessing:/workspace/data-preprocessing \
	  -v $(CURDIR)/glue:/workspace/glue \
	  -w /workspace/$(MODEL) $(IMAGE) pretrain
