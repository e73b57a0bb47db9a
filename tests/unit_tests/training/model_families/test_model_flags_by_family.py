"""Each pretrain script refuses the flags only another model reads, and T5 refuses pipeline
parallelism as Megatron does; checked through the dry run (the same check pretrain runs)."""

import pytest

from megatron.training.dry_run import main
from tests.harness.argv import MOCK_DATA, megatron_argv

SHAPE = [
    "--hidden-size", "64", "--num-attention-heads", "4", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--train-iters", "3",
]  # fmt: skip
GPT = megatron_argv(base=MOCK_DATA, num_layers=2, seq_length=64, vocab_size=100)
BERT = ["--dry-run-model", "bert", "--num-layers", "2", "--seq-length", "64"]
BERT += ["--vocab-file", "tests/data/bert-vocab.txt"]
T5 = ["--dry-run-model", "t5", "--encoder-num-layers", "2", "--decoder-num-layers", "2"]
T5 += ["--encoder-seq-length", "64", "--vocab-file", "tests/data/bert-vocab.txt"]
T5 += ["--vocab-extra-ids", "100"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (GPT + ["--mask-prob", "0.2"], "--mask-prob is read by pretrain_bert.py / pretrain_t5.py"),
        (GPT + ["--bert-no-binary-head"], "--bert-no-binary-head is read by pretrain_bert.py only"),
        (BERT + ["--decoder-seq-length", "32"], "--decoder-seq-length is read by pretrain_t5.py"),
        (T5 + ["--decoder-seq-length", "32", "--bert-no-binary-head"], "the t5 model would"),
        (T5 + ["--decoder-seq-length", "32", "--pipeline-model-parallel-size", "2"],
         "Pipeline parallelism is not supported for T5."),
        (T5, "T5 needs --decoder-seq-length"),
    ],
)  # fmt: skip
def test_refused(argv, message, capsys):
    assert main(argv + SHAPE + ["--dry-run-world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and message in err, err


@pytest.mark.parametrize(
    "argv",
    [
        BERT + ["--mask-prob", "0.2", "--short-seq-prob", "0.05", "--bert-no-binary-head"],
        T5 + ["--decoder-seq-length", "32", "--mask-prob", "0.2"],
        GPT,
    ],
)
def test_accepted(argv, capsys):
    assert main(argv + SHAPE) == 0, capsys.readouterr().err
