"""Megatron's command lines start unchanged.

The flag sets below are those of Megatron-LM's own launch scripts (GPT-3 175B, Llama-3 8B in
bf16), written out as a user copies them; they must pass the parser and validate_args for
their world size, with only speed-only flags reported as having no effect here. A typical
small command line then trains a few iterations on CPU (one process), and the smallest launch
script of examples/ trains for real with two processes.
"""

import os
import subprocess
import sys

import pytest

from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
from tests.functional_tests.runner import REPO, TINY_MODEL, env_for_tests, parse_log_lines

sys.path.insert(0, str(REPO))
import pretrain_gpt  # noqa: E402

GPT3_175B = """
--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
--max-position-embeddings 2048 --attention-backend auto
--micro-batch-size 1 --global-batch-size 1536 --train-iters 500000 --weight-decay 0.1
--adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5
--lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
--data-path /data/gpt3_text_document --vocab-file /data/gpt2-vocab.json
--merge-file /data/gpt2-merges.txt --split 949,50,1
--log-interval 100 --save-interval 10000 --eval-interval 1000 --save /ckpt --load /ckpt
--eval-iters 10 --tensorboard-dir /tb
"""

LLAMA3_8B_BF16 = """
--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
--num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
--seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
--rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000
--lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
--empty-unused-memory-level 1 --exit-duration-in-mins 235
--tensor-model-parallel-size 4 --context-parallel-size 2 --sequence-parallel
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-8B
--data-path /data/llama_text_document --split 99,1,0
--no-create-attention-mask-in-dataloader --num-workers 1
--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput
--profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist
--distributed-timeout-minutes 60 --save /ckpt --load /ckpt --tensorboard-dir /tb
--attention-softmax-in-fp32 --no-masked-softmax-fusion --no-bias-dropout-fusion
--tp-comm-overlap --use-nccl-ub
"""

# DeepSeek-V3 (a proxy) as Megatron's MoE model zoo launches it, without its --mtp-num-layers 1
# --mtp-loss-scaling-factor 0.1 (multi-token prediction is not built yet) and with 16 layers
# instead of 14 (14 do not split over its 8 pipeline stages; validate_args refuses that).
DEEPSEEK_V3_PROXY = """
--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 8
--expert-model-parallel-size 32 --context-parallel-size 1 --expert-tensor-parallel-size 1
--use-distributed-optimizer --use-mcore-models --sequence-parallel --use-flash-attn
--disable-bias-linear --micro-batch-size 1 --global-batch-size 1024 --train-samples 585937500
--exit-duration-in-mins 220 --no-check-for-nan-in-loss-and-grad --cross-entropy-loss-fusion
--cross-entropy-fusion-impl native --manual-gc --manual-gc-interval 10
--transformer-impl transformer_engine --seq-length 4096 --tokenizer-type NullTokenizer
--vocab-size 129280 --mock-data --split 99,1,0 --no-mmap-bin-files
--no-create-attention-mask-in-dataloader --num-workers 6 --num-layers 16 --hidden-size 7168
--ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128
--max-position-embeddings 4096 --position-embedding-type rope --rotary-base 10000
--make-vocab-size-divisible-by 3232 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
--untie-embeddings-and-output-weights --multi-latent-attention --attention-dropout 0.0
--hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm
--lr-decay-samples 584765624 --lr-warmup-samples 1536000 --lr-warmup-init 3.9e-7 --lr 3.9e-6
--min-lr 3.9e-7 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --num-experts 64
--moe-layer-freq ([0]*3+[1]*13) --moe-ffn-hidden-size 2048
--moe-shared-expert-intermediate-size 2048 --moe-router-load-balancing-type seq_aux_loss
--moe-router-topk 8 --moe-token-dispatcher-type flex --moe-enable-deepep
--moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 4
--moe-router-num-groups 8 --moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid
--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32
--moe-permute-fusion --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
--qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0
--mscale-all-dim 1.0 --eval-iters 32 --eval-interval 200 --save-interval 500 --init-method-std 0.02
--log-throughput --log-interval 1 --bf16
"""


@pytest.mark.parametrize(
    "flags, world_size, no_effect",
    [
        (GPT3_175B, 1024, ["--transformer-impl transformer_engine"]),
        (
            LLAMA3_8B_BF16,
            64,
            [
                "--transformer-impl transformer_engine",
                "--no-masked-softmax-fusion",
                "--no-bias-dropout-fusion",
                "--tp-comm-overlap",
                "--use-nccl-ub",
                "--empty-unused-memory-level 1",
                "--profile",
            ],
        ),
        (DEEPSEEK_V3_PROXY, 256, ["--moe-enable-deepep", "--moe-permute-fusion"]),
    ],
    ids=["gpt3_175b", "llama3_8b_bf16", "deepseek_v3_proxy"],
)
def test_megatron_launch_flags_pass_validation(flags, world_size, no_effect, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    args = validate_args(parse_args(argv=flags.split()))
    note = args.no_effect_note
    for flag in no_effect:
        assert f"{flag} (" in note or f"{flag}, " in note, (flag, note)


def test_the_fp8_llama_script_is_refused_with_one_reason(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "64")
    from megatron.training.arguments import ArgumentValidationError

    argv = LLAMA3_8B_BF16.split() + ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"]
    with pytest.raises(ArgumentValidationError) as info:
        validate_args(parse_args(argv=argv))
    assert str(info.value).startswith("not supported yet: --fp8-format hybrid (fp8/fp4 training")


def test_a_typical_command_line_trains_on_cpu(tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    argv = TINY_MODEL + [
        "--train-iters", "3", "--bf16", "--attention-softmax-in-fp32", "--use-flash-attn",
        "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--use-distributed-optimizer",
        "--overlap-grad-reduce", "--check-weight-hash-across-dp-replicas-interval", "10",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "3", "--ckpt-format", "torch_dist",
        "--verify-integrity", "--manual-gc", "--use-mcore-models",
    ]  # fmt: skip
    global_vars.reset_globals()
    try:
        pretrain_gpt.pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            pretrain_gpt.ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
            argv=argv,
        )
    finally:
        global_vars.reset_globals()
    out = capsys.readouterr().out
    assert sorted(parse_log_lines(out)) == [1, 2, 3]
    notes = [line for line in out.splitlines() if "no effect here (speed only):" in line]
    assert len(notes) == 1 and notes[0].startswith(" > no effect here (speed only): ")
    assert "--no-masked-softmax-fusion" in notes[0] and "--no-bias-dropout-fusion" in notes[0]
    assert os.path.isfile(tmp_path / "ckpt" / "iter_0000003" / "integrity.sha256")


def test_the_tiny_cpu_example_trains_for_real(tmp_path):
    """The smallest launch script, unchanged, through torchrun with 2 CPU processes."""
    env = env_for_tests()
    env.update(MOCK="1", NPROC="2", ITERS="12", RUN_DIR=str(tmp_path / "run"))
    env.update(NUM_LAYERS="2", HIDDEN="64", SEQ="64", MBS="2", GBS="8")  # its size knobs
    result = subprocess.run(
        ["bash", str(REPO / "examples" / "gpt3" / "tiny_cpu.sh")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert sorted(parse_log_lines(result.stdout)) == [10]
    assert os.path.isfile(tmp_path / "run" / "checkpoints" / "iter_0000012" / "metadata.json")
