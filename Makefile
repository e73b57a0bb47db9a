# Everyday commands. `make test` and `make quickstart` work on a fresh CPU machine.
PYTHON ?= python
NPROC ?= 2
RUN_DIR ?= runs/quickstart
PIP_INSTALL = $(PYTHON) -m pip install -q -c constraints.txt

.PHONY: install test test-fast quickstart quickstart-mock prepare-ds-sample clean

install:
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e .[dev]

test: install
	$(PYTHON) -m pytest -q tests

test-fast:
	$(PYTHON) -m pytest -q tests/unit_tests

# Tokenize the shipped sample corpus into Megatron .bin/.idx files.
prepare-ds-sample:
	$(PYTHON) tools/preprocess_data.py --input tests/data/corpus.jsonl --output-prefix $(RUN_DIR)/data/corpus \
		--tokenizer-type GPT2BPETokenizer --vocab-file tests/data/gpt2-vocab.json \
		--merge-file tests/data/gpt2-merges.txt --append-eod --workers 2

# A tiny GPT trained on the sample corpus with 2 CPU processes (data parallel).
quickstart: install prepare-ds-sample
	NPROC=$(NPROC) RUN_DIR=$(RUN_DIR) DATA_PATH=$(RUN_DIR)/data/corpus_text_document bash examples/gpt3/tiny_cpu.sh

# The same on generated (mock) data.
quickstart-mock: install
	NPROC=$(NPROC) RUN_DIR=$(RUN_DIR) MOCK=1 bash examples/gpt3/tiny_cpu.sh

clean:
	rm -rf runs
