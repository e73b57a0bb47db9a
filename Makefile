# Everyday commands. `make test` and `make quickstart` work on a fresh CPU machine.
PYTHON ?= python
NPROC ?= 2
RUN_DIR ?= runs/quickstart
PIP_INSTALL = $(PYTHON) -m pip install -q -c constraints.txt

.PHONY: install install-cpu install-gpu lint test test-faults test-fast interop quickstart quickstart-mamba \
	quickstart-mock prepare-ds-sample clean prepare-ds-sample-bert quickstart-bert quickstart-t5 \
	gpu-check gpu-perf

# A CUDA build of torch already installed (an NGC container, a cluster image) is kept: install-gpu.
# Otherwise the pinned CPU build: install-cpu.
install:
	@if $(PYTHON) -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; \
	then $(MAKE) --no-print-directory install-gpu; else $(MAKE) --no-print-directory install-cpu; fi

install-cpu:
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e .[dev]

# The package and its other requirements with torch held at the installed build (a constraint
# torch==<installed version>, so pip neither replaces nor upgrades it). Needs pip's index for the
# missing packages; without a network run from the checkout instead (PYTHONPATH, see README.md).
install-gpu:
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "error: install-gpu keeps the installed \
	torch and there is none; make install-cpu installs the CPU build" >&2; exit 2; }
	@pin=$$(mktemp) && $(PYTHON) -c "import torch; print('torch==' + torch.__version__)" >$$pin && \
	echo "keeping $$(cat $$pin) (CUDA $$($(PYTHON) -c 'import torch; print(torch.version.cuda)'))" && \
	$(PYTHON) -m pip install -q -c $$pin -e .[dev]; status=$$?; rm -f $$pin; exit $$status

# Every GPU check in one command (see benchmarks/README.md); CHECK_MODE=cpu for the tiny CPU run.
gpu-check:
	PYTHON=$(PYTHON) bash benchmarks/gpu/check.sh

gpu-perf:
	PYTHON=$(PYTHON) bash benchmarks/gpu/perf.sh

# ruff (configured in pyproject.toml): lint rules and the formatting the tree is kept in.
lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .

# Lint first; --durations=15: the slowest tests, so that the suite's growth stays visible.
# Every test runs, the fault-injection ones (marker `faults`) included. Two pytest workers, each
# test file on one of them (-n 2 --dist loadfile): one worker's unit tests fill the core the
# other's multi-process runs leave idle (14.4 min instead of 18.9 min on 2 cores).
test: install lint
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --durations=15 tests

# Only the fault-injection runs (a stopped rank, SIGTERM to the launcher, a full disk, kill -9
# mid-iteration), which `make test` runs too: ~1.5 min.
test-faults: install
	$(PYTHON) -m pytest -q --durations=15 -m faults tests

test-fast:
	$(PYTHON) -m pytest -q --durations=15 tests/unit_tests

# torch_dist checkpoints exchanged with the real megatron-core, both ways (tests/interop). It
# runs in its own environment (its import name `megatron` is ours too), made once in
# MCORE_VENV with the same pinned CPU torch; not part of `make test` (see README.md for cost).
MCORE_VENV ?= .venv-mcore
MCORE_VERSION ?= 0.16.1
interop: install
	test -x $(MCORE_VENV)/bin/python || $(PYTHON) -m venv $(MCORE_VENV)
	$(MCORE_VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0 \
		megatron-core==$(MCORE_VERSION) psutil
	MCORE_PYTHON=$(MCORE_VENV)/bin/python $(PYTHON) -m pytest -q --durations=5 tests/interop

# Tokenize the shipped sample corpus into Megatron .bin/.idx files.
prepare-ds-sample:
	$(PYTHON) tools/preprocess_data.py --input tests/data/corpus.jsonl --output-prefix $(RUN_DIR)/data/corpus \
		--tokenizer-type GPT2BPETokenizer --vocab-file tests/data/gpt2-vocab.json \
		--merge-file tests/data/gpt2-merges.txt --append-eod --workers 2

# A tiny GPT trained on the sample corpus with 2 CPU processes (data parallel).
quickstart: install prepare-ds-sample
	NPROC=$(NPROC) RUN_DIR=$(RUN_DIR) DATA_PATH=$(RUN_DIR)/data/corpus_text_document bash examples/gpt3/tiny_cpu.sh

# The sample corpus split into sentences and WordPiece-tokenized, for BERT and T5
# (<RUN_DIR>/data/corpus_text_sentence). The sentence splitter is built in (NLTK is optional).
prepare-ds-sample-bert:
	$(PYTHON) tools/preprocess_data.py --input tests/data/corpus.jsonl --output-prefix $(RUN_DIR)/data/corpus \
		--tokenizer-type BertWordPieceLowerCase --vocab-file tests/data/bert-vocab.txt \
		--split-sentences --workers 2

# A tiny BERT / T5 trained on the sentence-split sample corpus with 2 CPU processes.
quickstart-bert: install prepare-ds-sample-bert
	NPROC=$(NPROC) RUN_DIR=$(RUN_DIR)/bert DATA_PATH=$(RUN_DIR)/data/corpus_text_sentence bash examples/bert/tiny_cpu.sh

quickstart-t5: install prepare-ds-sample-bert
	NPROC=$(NPROC) RUN_DIR=$(RUN_DIR)/t5 DATA_PATH=$(RUN_DIR)/data/corpus_text_sentence bash examples/t5/tiny_cpu.sh

# A tiny hybrid Mamba / attention model (Nemotron-H style layers, pretrain_mamba.py) trained on
# the sample corpus with 2 CPU processes.
quickstart-mamba: install prepare-ds-sample
	NPROC=$(NPROC) RUN_DIR=$(RUN_DIR)/mamba DATA_PATH=$(RUN_DIR)/data/corpus_text_document bash examples/mamba/tiny_cpu.sh

# The same on generated (mock) data.
quickstart-mock: install
	NPROC=$(NPROC) RUN_DIR=$(RUN_DIR) MOCK=1 bash examples/gpt3/tiny_cpu.sh

clean:
	rm -rf runs

# ---------------------------------------------------------------------------------------------
# Data, ablations and plots (see "Launch scripts and ablations" in README.md).
DATA_DIR ?= runs/data
GPT2_LARGE = examples/gpt2/train_gpt2_large.sh

.PHONY: train-baseline-gpt2large-1gpu train-dp2-gpt2large-2gpu train-tp2-gpt2large-2gpu \
	train-sp2-gpt2large-2gpu train-cp2-gpt2large-2gpu train-pp2-gpt2large-2gpu \
	plot-gpt2large ablate-cpu dry-run-examples tiny-deepseek-cpu

# Tokenize tests/data/<name>.jsonl (or INPUT=<file.jsonl>) into $(DATA_DIR)/<name>_text_document
# with the GPT-2 BPE of tests/data, e.g. `make prepare-ds-corpus`. (A pattern rule cannot be
# .PHONY; an explicit target such as prepare-ds-sample takes precedence over it.)
prepare-ds-%:
	@test -f "$(or $(INPUT),tests/data/$*.jsonl)" || \
		{ echo "error: $(or $(INPUT),tests/data/$*.jsonl) does not exist (set INPUT=<file.jsonl>)" >&2; exit 2; }
	$(PYTHON) tools/preprocess_data.py --input $(or $(INPUT),tests/data/$*.jsonl) \
		--output-prefix $(DATA_DIR)/$* --tokenizer-type GPT2BPETokenizer \
		--vocab-file tests/data/gpt2-vocab.json --merge-file tests/data/gpt2-merges.txt \
		--append-eod --workers 2

$(DATA_DIR)/%_text_document.bin:
	$(MAKE) prepare-ds-$*

# GPT-2 large (774M) in each parallel layout on GPUs; logs in runs/gpt2large/<layout>.log.
# Pass DATA_PATH=<prefix> for a corpus (mock data otherwise), ITERS=, MBS=, GBS=, PRECISION=.
train-baseline-gpt2large-1gpu:
	LAYOUT=baseline bash $(GPT2_LARGE)
train-dp2-gpt2large-2gpu:
	LAYOUT=dp2 bash $(GPT2_LARGE)
train-tp2-gpt2large-2gpu:
	LAYOUT=tp2 bash $(GPT2_LARGE)
train-sp2-gpt2large-2gpu:
	LAYOUT=sp2 bash $(GPT2_LARGE)
train-cp2-gpt2large-2gpu:
	LAYOUT=cp2 bash $(GPT2_LARGE)
train-pp2-gpt2large-2gpu:
	LAYOUT=pp2 bash $(GPT2_LARGE)

# The curves of whichever GPT-2 large layouts have run, in one PNG.
GPT2_LARGE_LOGS = $(wildcard $(addprefix runs/gpt2large/,$(addsuffix .log,baseline dp2 tp2 sp2 cp2 pp2)))
plot-gpt2large:
	@test -n "$(GPT2_LARGE_LOGS)" || { echo "error: no runs/gpt2large/<layout>.log yet; run a train-*-gpt2large-* target" >&2; exit 2; }
	$(PYTHON) tools/plot_logs.py $(GPT2_LARGE_LOGS) --output runs/gpt2large/ablation.png

# The same six layouts on a tiny GPT on CPU (1-2 processes, the sample corpus), logs side by side
# in runs/ablate-cpu/<layout>.log, drawn into runs/ablate-cpu/ablation.png.
ablate-cpu: $(DATA_DIR)/corpus_text_document.bin
	PYTHON=$(PYTHON) DATA_PATH=$(DATA_DIR)/corpus_text_document bash examples/gpt2/ablate_cpu.sh

# Mixture of experts on CPU: a tiny MoE GPT at EP=1, EP=2 and EP=2 x TP=2 (1, 2 and 4 processes,
# mock data), logs in runs/ablate-moe-cpu/<layout>.log, curves in runs/ablate-moe-cpu/ablation.png.
ablate-moe-cpu:
	PYTHON=$(PYTHON) bash examples/mixtral/ablate_moe_cpu.sh

# A tiny DeepSeek-V3 (MLA, dense first layer, routed + shared experts with the sigmoid router
# and expert bias, group-limited top-k, one MTP layer) trained a few iterations on CPU, mock
# data; LAYOUT=ep2 or pp2 for 2 processes. Log in runs/tiny_deepseek_cpu/<layout>.log.
tiny-deepseek-cpu:
	PYTHON=$(PYTHON) bash examples/deepseek_v3/tiny_cpu.sh

# Validate every launch script's flags (DRY_RUN=1) and print its layout.
dry-run-examples:
	@for script in examples/gpt3/train_gpt3_*.sh examples/llama/train_*.sh \
		examples/bert/train_bert_*.sh examples/t5/train_t5_*.sh examples/mixtral/train_*.sh \
		examples/deepseek_v3/train_*.sh examples/mamba/train_*.sh; do \
		echo "=== $$script"; DRY_RUN=1 PYTHON=$(PYTHON) bash $$script 2>&1 | grep -E '^  |error|dry run OK'; \
	done
