"""Megatron-LM's own pretraining test configurations that use --fim-data and --use-torch-fsdp2
run here, shrunk to CPU sizes.

The flags are those of tests/functional_tests/test_cases/gpt/<name>/model_config.yaml in
Megatron-LM, written out as the YAML gives them; only the sizes (layers, hidden size, heads,
sequence length, batch sizes, iterations), the data paths and the backend (gloo) are replaced.
Each run must start with nothing refused; the flags that only select GPU kernels are reported as
having no effect here.

* gpt3_mcore_te_tp1_pp1_dist_optimizer_fim_dataset (and its _1node twin, same flags): FIM on a
  GPT-2 BPE dataset with the default FIM tokens, which GPT-2's vocabulary lacks, so they are its
  unknown token <|endoftext|> as in Megatron-LM; one process, distributed optimizer, bf16,
  asynchronous save at the end.
* gpt3_345m_nightly_dgx_a100_1N8G_mcore_tp1_pp1_fsdp2_resume_torch_dist_te (TEST_TYPE
  ckpt-resume): FSDP2 at DP=2 with tied embeddings saves a torch_dist checkpoint halfway and a
  second run resumes from it with the same losses. Two of its flags are changed, as Megatron-LM
  itself rejects them: --no-async-tensor-model-parallel-allreduce no longer exists (dropped), and
  FSDP2 with --fp16 fails Megatron's validate_args ("--use-torch-fsdp2 not supported with fp16
  yet"), so the run is --bf16.
"""

import json

import numpy as np

from tests.functional_tests.runner import REPO, parse_log_lines, run_pretrain


def argv(flags):
    out = []
    for name, value in flags.items():
        if value is True:
            out.append(name)
        elif value is not False:
            out += [name, str(value)]
    return out


SHRUNK = {
    "--num-layers": 2,
    "--hidden-size": 64,
    "--num-attention-heads": 4,
    "--micro-batch-size": 2,
    "--global-batch-size": 8,
    "--seq-length": 64,
    "--max-position-embeddings": 64,
}


def fim_config(tmp_path, data):
    return {
        **SHRUNK,
        "--log-params-norm": True,
        "--log-num-zeros-in-grad": True,
        "--log-validation-ppl-to-tensorboard": True,
        "--log-timers-to-tensorboard": True,
        "--tensorboard-dir": tmp_path / "tb",
        "--train-iters": 4,
        "--timing-log-level": 0,
        "--lr-decay-iters": 320000,
        "--save": tmp_path / "ckpt",
        "--load": tmp_path / "ckpt",
        "--data-path": data,
        "--vocab-file": REPO / "tests/data/gpt2-vocab.json",
        "--merge-file": REPO / "tests/data/gpt2-merges.txt",
        "--split": "949,50,1",
        "--distributed-backend": "gloo",
        "--lr": 0.00015,
        "--lr-decay-style": "cosine",
        "--min-lr": 1.0e-5,
        "--weight-decay": 1e-2,
        "--clip-grad": 1.0,
        "--lr-warmup-fraction": 0.01,
        "--log-interval": 1,
        "--save-interval": 10000,
        "--eval-interval": 1000,
        "--eval-iters": 2,
        "--transformer-impl": "transformer_engine",
        "--tensor-model-parallel-size": 1,
        "--pipeline-model-parallel-size": 1,
        "--use-distributed-optimizer": True,
        "--deterministic-mode": True,
        "--no-gradient-accumulation-fusion": True,
        "--attention-softmax-in-fp32": True,
        "--use-mcore-models": True,
        "--ckpt-format": "torch_dist",
        "--dist-ckpt-strictness": "log_all",
        "--data-cache-path": tmp_path / "cache",
        "--bf16": True,
        "--attention-backend": "unfused",
        "--log-memory-to-tensorboard": True,
        "--fim-data": True,
        "--fim-rate": 0.5,
        "--fim-spm-rate": 0.5,
        "--async-save": True,
        "--use-persistent-ckpt-worker": True,
        "--num-workers": 0,
    }


def fsdp2_config(tmp_path):
    return {
        **SHRUNK,
        "--log-params-norm": True,
        "--log-num-zeros-in-grad": True,
        "--log-validation-ppl-to-tensorboard": True,
        "--log-timers-to-tensorboard": True,
        "--tensorboard-dir": tmp_path / "tb",
        "--train-iters": 6,
        "--timing-log-level": 2,
        "--lr-decay-iters": 320000,
        "--save": tmp_path / "ckpt",
        "--load": tmp_path / "ckpt",
        "--mock-data": True,
        "--tokenizer-type": "NullTokenizer",
        "--vocab-size": 500,
        "--split": "949,50,1",
        "--distributed-backend": "gloo",
        "--lr": 0.00015,
        "--lr-decay-style": "cosine",
        "--min-lr": 1.0e-5,
        "--weight-decay": 1e-2,
        "--clip-grad": 1.0,
        "--lr-warmup-fraction": 0.01,
        "--log-interval": 1,
        "--save-interval": 3,
        "--eval-interval": 1000,
        "--eval-iters": 1,
        "--transformer-impl": "transformer_engine",
        "--tensor-model-parallel-size": 1,
        "--pipeline-model-parallel-size": 1,
        "--use-torch-fsdp2": True,
        "--deterministic-mode": True,
        "--no-gradient-accumulation-fusion": True,
        "--use-checkpoint-opt_param-scheduler": True,
        "--use-mcore-models": True,
        "--ckpt-format": "torch_dist",
        "--dist-ckpt-optim-fully-reshardable": True,
        "--dist-ckpt-strictness": "log_all",
        "--bf16": True,  # --fp16 in the YAML: see the module docstring
        "--apply-query-key-layer-scaling": True,
        "--log-memory-to-tensorboard": True,
        "--num-workers": 0,
    }


def gpt2_dataset(prefix):
    """The shipped corpus as GPT-2 BPE ids with an EOD after each document (its 3,228 documents
    leave a few to the 0.1 % test split of --split 949,50,1)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer

    tok = GPT2BPETokenizer(
        str(REPO / "tests/data/gpt2-vocab.json"), str(REPO / "tests/data/gpt2-merges.txt")
    )
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    with open(REPO / "tests/data/corpus.jsonl") as corpus:
        for line in corpus:
            ids = tok.tokenize(json.loads(line)["text"]) + [tok.eod]
            builder.add_document(np.array(ids, dtype=np.int64), [len(ids)])
    builder.finalize(prefix + ".idx")
    return prefix


def _no_effect_note(stdout):
    notes = {line for line in stdout.splitlines() if "no effect here (speed only):" in line}
    assert len(notes) == 1, notes
    return notes.pop()


def test_the_fim_dataset_configuration_runs(tmp_path):
    data = gpt2_dataset(str(tmp_path / "corpus"))
    result = run_pretrain(argv(fim_config(tmp_path, data)))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert sorted(parse_log_lines(result.stdout)) == [1, 2, 3, 4]
    note = _no_effect_note(result.stdout)
    assert "--transformer-impl transformer_engine" in note, note
    # Gradient accumulation fusion is built here: turning it off is honoured, not a no-op.
    assert "--no-gradient-accumulation-fusion" not in note, note
    # The default FIM tokens are not GPT-2 tokens: they become its unknown token, with a warning.
    assert "--fim-prefix-token '<fim_prefix>' is not in the tokenizer's vocabulary" in (
        result.stderr
    )
    assert (tmp_path / "ckpt" / "iter_0000004" / "metadata.json").is_file()


def test_the_fsdp2_resume_configuration_runs_and_resumes(tmp_path):
    config = fsdp2_config(tmp_path)
    first = run_pretrain(argv(config), nproc=2)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert "--transformer-impl transformer_engine" in _no_effect_note(first.stdout)
    straight = parse_log_lines(first.stdout)
    assert sorted(straight) == list(range(1, 7))
    resumed = run_pretrain(argv(config) + ["--ckpt-step", "3"], nproc=2)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    again = parse_log_lines(resumed.stdout)
    assert sorted(again) == [4, 5, 6]
    for it in again:
        for key in ("lm loss",):
            assert again[it]["losses"][key] == straight[it]["losses"][key], (it, again, straight)
        assert again[it]["grad_norm"] == straight[it]["grad_norm"], it
        assert again[it]["params_norm"] == straight[it]["params_norm"], it
