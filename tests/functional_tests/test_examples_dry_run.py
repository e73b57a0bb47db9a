"""Every launch script under examples/ passes its DRY_RUN=1 mode: the real parser and
validate_args accept its flags for WORLD_SIZE = GPUS_PER_NODE x NNODES, and the printed layout
is the one the script means. Parameter counts are checked against published model sizes."""

import contextlib
import io
import os
import re
import subprocess
from types import SimpleNamespace

import pytest

from tests.harness import REPO
from tests.harness.argv import megatron_argv

# Variables the scripts read; cleared so the caller's environment cannot change the layouts.
SCRIPT_ENV = (
    "GPUS_PER_NODE",
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TP",
    "PP",
    "CP",
    "SP",
    "MBS",
    "GBS",
    "DATA_PATH",
    "CHECKPOINT_PATH",
    "TENSORBOARD_PATH",
    "VOCAB_FILE",
    "MERGE_FILE",
    "VOCAB_SIZE",
    "TOKENIZER_MODEL",
    "SEQ_LENGTH",
    "LAYOUT",
    "NUM_LAYERS",
    "HIDDEN_SIZE",
    "NUM_HEADS",
    "LOG_FILE",
    "WORLD_SIZE",
    "RANK",
    "MAKE_VOCAB_SIZE_DIVISIBLE_BY",
    "PRECISION",
    "HIDDEN",
    "HEADS",
    "SEQ",
    "ITERS",
    "MOCK",
    "NPROC",
    "RUN_DIR",
)

# id: (script, extra env, expected layout, expected parameters or None).
# Layout: world size, TP, PP, CP, DP, micro-batch size, global batch size, sequence length.
GPT2_LARGE_PARAMS = 774_030_080 + (50_304 - 50_257) * 1280  # HF gpt2-large + padded vocab rows
CASES = {
    "tiny_cpu_mock": (
        "examples/gpt3/tiny_cpu.sh",
        {"MOCK": "1"},
        (2, 1, 1, 1, 2, 4, 16, 128),
        None,
    ),
    "tiny_cpu_corpus": (
        "examples/gpt3/tiny_cpu.sh",
        {"DATA_PATH": "runs/data/x_text_document"},
        (2, 1, 1, 1, 2, 4, 16, 128),
        None,
    ),
    "gpt3_125m": ("examples/gpt3/train_gpt3_125m.sh", {}, (8, 1, 1, 1, 8, 4, 256, 2048), None),
    "gpt3_345m": ("examples/gpt3/train_gpt3_345m.sh", {}, (8, 1, 1, 1, 8, 4, 256, 2048), None),
    "gpt3_857m": ("examples/gpt3/train_gpt3_857m.sh", {}, (8, 1, 1, 1, 8, 2, 256, 2048), None),
    "gpt3_1.3b": ("examples/gpt3/train_gpt3_1.3b.sh", {}, (8, 1, 1, 1, 8, 2, 512, 2048), None),
    "gpt3_175b": (
        "examples/gpt3/train_gpt3_175b_distributed.sh",
        {},
        (1024, 8, 16, 1, 8, 1, 1536, 2048),
        None,
    ),
    "gpt3_175b_pp1": (
        "examples/gpt3/train_gpt3_175b_distributed.sh",
        {"PP": "1", "NNODES": "8"},
        (64, 8, 1, 1, 8, 1, 1536, 2048),
        None,
    ),
    "llama2_7b": (
        "examples/llama/train_llama2_7b.sh",
        {},
        (8, 2, 1, 1, 4, 1, 1024, 4096),
        6_738_415_616,
    ),
    "llama3_8b": ("examples/llama/train_llama3_8b.sh", {}, (8, 4, 1, 2, 1, 1, 128, 8192), None),
    "llama3_8b_tp1": (
        "examples/llama/train_llama3_8b.sh",
        {"TP": "1", "CP": "1"},
        (8, 1, 1, 1, 8, 1, 128, 8192),
        8_030_261_248,
    ),
    "llama3_70b": ("examples/llama/train_llama3_70b.sh", {}, (64, 8, 4, 1, 2, 1, 256, 8192), None),
    "llama3_70b_pp1": (
        "examples/llama/train_llama3_70b.sh",
        {"TP": "1", "PP": "1", "NNODES": "1"},
        (8, 1, 1, 1, 8, 1, 256, 8192),
        70_553_706_496,
    ),
    # Mixtral 8x7B has 46,702,792,704 parameters (Hugging Face's count); the vocabulary 32000 is
    # padded to 32128 here (--make-vocab-size-divisible-by 128) in both untied embeddings.
    "mixtral_8x7b": (
        "examples/mixtral/train_mixtral_8x7b_distributed.sh",
        {},
        (32, 1, 4, 1, 8, 1, 256, 4096),
        46_702_792_704 + 2 * 128 * 4096,
    ),
    "tiny_moe_ep2tp2": (
        "examples/mixtral/tiny_moe_cpu.sh",
        {"LAYOUT": "ep2tp2"},
        (4, 2, 1, 1, 2, 4, 16, 128),
        None,
    ),
}
for _layout, _shape in {
    "baseline": (1, 1, 1, 1, 1),
    "dp2": (2, 1, 1, 1, 2),
    "tp2": (2, 2, 1, 1, 1),
    "sp2": (2, 2, 1, 1, 1),
    "cp2": (2, 1, 1, 2, 1),
    "pp2": (2, 1, 2, 1, 1),
}.items():
    CASES[f"gpt2large_{_layout}"] = (
        "examples/gpt2/train_gpt2_large.sh",
        {"LAYOUT": _layout},
        _shape + (4, 32, 1024),
        GPT2_LARGE_PARAMS,
    )

# DeepSeek-V3: 256 GPUs at TP=1, PP=8, EP=32; its main model is checked against transformers'
# DeepseekV3ForCausalLM below.
CASES["deepseek_v3_671b"] = (
    "examples/deepseek_v3/train_deepseek_v3_671b.sh",
    {},
    (256, 1, 8, 1, 32, 1, 2048, 4096),
    None,
)
CASES["tiny_deepseek_v3_pp2"] = (
    "examples/deepseek_v3/tiny_cpu.sh",
    {"LAYOUT": "pp2"},
    (2, 1, 2, 1, 1, 2, 8, 64),
    None,
)

# BERT-large with the shipped WordPiece vocabulary (7936 rows once padded): transformers'
# MegatronBertForPreTraining of that shape counts 313,075,458 parameters (built on the meta device).
CASES["bert_340m"] = (
    "examples/bert/train_bert_340m_distributed.sh",
    {},
    (8, 1, 1, 1, 8, 4, 32, 512),
    313_075_458,
)
CASES["t5_220m_tp2"] = (
    "examples/t5/train_t5_220m_distributed.sh",
    {"TP": "2"},
    (8, 2, 1, 1, 4, 64, 512, 512),
    None,
)
CASES["mamba_tiny_cpu_mock"] = (
    "examples/mamba/tiny_cpu.sh",
    {"MOCK": "1"},
    (2, 1, 1, 1, 2, 4, 16, 128),
    None,
)
# transformers 5.24's NemotronHForCausalLM built (on the meta device) from Nemotron-H-8B's
# published sizes (Megatron-Bridge's NemotronHModel8BProvider: the 52-layer pattern, hidden 4096,
# ffn 21504, 32 heads in 8 groups of 128, Mamba 128 heads of 64, 8 groups, state 128, conv 4;
# vocabulary 131072, untied), counting its parameters.
NEMOTRON_H_8B_PARAMS = 8_100_852_736
CASES["nemotron_h_8b_tp2"] = (
    "examples/mamba/train_nemotron_h_8b.sh",
    {},
    (8, 2, 1, 1, 4, 1, 768, 8192),
    NEMOTRON_H_8B_PARAMS,
)

# Published sizes of the GPT-3 paper (table 2.1), to 2 %: the counts are rounded there.
GPT3_PAPER = {
    "gpt3_125m": 125e6,
    "gpt3_345m": 350e6,
    "gpt3_857m": 760e6,
    "gpt3_1.3b": 1.3e9,
    "gpt3_175b_pp1": 175e9,
}

LAYOUT_LINE = re.compile(r"^  (.+?) \.+ (.+)$", re.M)


def _script_env(extra_env):
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_ENV}
    env.update({"DRY_RUN": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, **extra_env)
    return env


def _run_for_real(case):
    """The script's DRY_RUN=1 mode as a user runs it (a fresh interpreter, ~2 s)."""
    script, extra_env, _, _ = CASES[case]
    return subprocess.run(
        ["bash", str(REPO / script)],
        cwd=REPO,
        env=_script_env(extra_env),
        capture_output=True,
        text=True,
        timeout=240,
    )


def _make_stub(directory):
    stub = directory / "record_argv.sh"
    stub.write_text('#!/bin/bash\nprintf "%s\\0" "$WORLD_SIZE" "$@" > "$CAPTURE_FILE"\n')
    stub.chmod(0o755)
    return stub


def _run_captured(script, extra_env, stub, capture):
    """The script with PYTHON pointing at a stub that records the dry-run command line; the
    dry run itself then runs in this process (importing torch once for all cases)."""
    from megatron.training.dry_run import main

    env = _script_env(extra_env)
    env.update(PYTHON=str(stub), CAPTURE_FILE=str(capture))
    launched = subprocess.run(
        ["bash", str(REPO / script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert launched.returncode == 0, launched.stderr
    world_size, module_flag, module, *argv = capture.read_text().split("\0")[:-1]
    assert (module_flag, module) == ("-m", "megatron.training.dry_run")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["--dry-run-world-size", world_size] + argv)
        except SystemExit as exc:  # argparse: unknown flag or bad value
            code = exc.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dry_run")
    stub = _make_stub(tmp)
    return {
        case: _run_captured(script, env, stub, tmp / f"{case}.argv")
        for case, (script, env, _, _) in CASES.items()
    }


def _layout(stdout):
    return {name: value for name, value in LAYOUT_LINE.findall(stdout)}


@pytest.mark.parametrize("case", list(CASES))
def test_dry_run_layout(results, case):
    script, _, expected, params = CASES[case]
    world, tp, pp, cp, dp, mbs, gbs, seq = expected
    result = results[case]
    assert result.returncode == 0, f"{script}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "dry run OK" in result.stdout
    layout = _layout(result.stdout)
    got = tuple(
        int(layout[name])
        for name in (
            "world size",
            "tensor model parallel size (TP)",
            "pipeline model parallel size (PP)",
            "context parallel size (CP)",
            "data parallel size (DP)",
            "micro batch size",
            "global batch size",
            "sequence length",
        )
    )
    assert got == expected
    assert tp * pp * cp * dp == world
    assert int(layout["micro-batches per step"]) * mbs * dp == gbs
    assert int(layout["tokens per step"]) == gbs * seq
    assert layout["sequence parallel"] == (
        "on"
        if case == "gpt2large_sp2" or (tp > 1 and not case.startswith(("gpt2large", "t5_")))
        else "off"
    )
    total = int(layout["parameters"].split()[0])
    if params is not None:
        assert total == params
    if case in GPT3_PAPER:
        assert total == pytest.approx(GPT3_PAPER[case], rel=0.02)
    largest = int(layout["parameters on the largest model-parallel rank"].split()[0])
    # Experts are further split over EP x ETP (beyond the dense TP).
    expert_split = max(
        1,
        int(layout["expert model parallel size (EP)"])
        * int(layout["expert tensor parallel size (ETP)"])
        // tp,
    )
    assert total / (tp * pp * expert_split) <= largest <= total


def test_deepseek_v3_counts_671b_parameters_and_37b_active(results):
    """DeepSeek quotes 671B parameters for the main model and 37B activated per token; the MTP
    module (14B in its count, with its own copies of embedding and output head) comes on top.
    The main model's count equals transformers' DeepseekV3ForCausalLM of the same configuration
    (built on the meta device; it has no MTP layer), where the router's expert bias is a buffer,
    as here; its active count is that total less the 248 of 256 routed experts a token skips."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    result = results["deepseek_v3_671b"]
    assert result.returncode == 0, result.stderr
    layout = _layout(result.stdout)
    config = DeepseekV3Config(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        first_k_dense_replace=3,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        hf = DeepseekV3ForCausalLM(config)
    hf_total = sum(p.numel() for p in hf.parameters())
    hf_routed = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    hf_active = hf_total - hf_routed * (256 - 8) // 256
    main = int(layout["parameters of the main model"].split()[0])
    mtp = int(layout["parameters of the MTP layers"].split()[0])
    assert main == hf_total and int(layout["parameters"].split()[0]) == main + mtp
    assert round(main / 1e9) == 671 and 13e9 < mtp + 2 * 129280 * 7168 < 14e9
    active = re.search(r"(\d+) \(\S+\) active per token in the main model", layout["experts"])
    assert int(active.group(1)) == hf_active and int(hf_active / 1e9) == 37


@pytest.mark.parametrize("case", ["llama2_7b", "gpt3_175b"])
def test_dry_run_end_to_end_matches_in_process_result(results, case):
    """The scripts' real DRY_RUN=1 path (python -m megatron.training.dry_run, WORLD_SIZE from
    GPUS_PER_NODE x NNODES) gives the same exit status and layout as the captured run."""
    real, captured = _run_for_real(case), results[case]
    assert real.returncode == captured.returncode == 0, real.stderr
    assert _layout(real.stdout) == _layout(captured.stdout)


def test_dry_run_rejects_bad_layouts_with_the_parser_message(tmp_path):
    """A world size that does not factor is refused by validate_args, as in a real run."""
    result = _run_captured(
        "examples/llama/train_llama2_7b.sh",
        {"GPUS_PER_NODE": "6", "TP": "4"},
        _make_stub(tmp_path),
        tmp_path / "argv",
    )
    assert result.returncode == 2
    assert (
        "error: world size (6) is not divisible by tensor-model-parallel size (4)" in result.stderr
    )


def test_dry_run_refuses_query_groups_split_across_tp_ranks(capsys):
    """Query groups split across TP ranks pass every other check, while every rank of a real
    run would die building the model: validate_args refuses them, so the dry run must not
    print OK."""
    from megatron.training.dry_run import main

    flags = megatron_argv(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        max_position_embeddings=16,
        micro_batch_size=1,
        vocab_size=100,
        train_iters=1,
        lr=None,
        group_query_attention=True,
        num_query_groups=1,
    )
    code = main(["--dry-run-world-size", "2", "--tensor-model-parallel-size", "2"] + flags)
    captured = capsys.readouterr()
    assert code == 2 and "dry run OK" not in captured.out
    assert captured.err == (
        "error: --num-query-groups (1) must be a multiple of --tensor-model-parallel-size (2)\n"
    )


def _args(argv):
    from tests.unit_tests.tiny_configs import validated_args

    return validated_args(argv, defaults={"tokenizer_type": "GPT2BPETokenizer"})


@pytest.mark.parametrize(
    "flags",
    [
        # GPT-2 style: learned positions, LayerNorm, biases, tied embeddings.
        [],
        # Llama style: RoPE, RMSNorm, SwiGLU, GQA, untied, no biases, plus qk-layernorm.
        [
            "--position-embedding-type",
            "rope",
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
            "--qk-layernorm",
            "--ffn-hidden-size",
            "80",
        ],
    ],
)
def test_parameter_formula_matches_the_built_model(flags):
    """count_parameters (a formula over the flags) equals the parameters of the GPTModel that
    pretrain_gpt.py's model provider builds from the same flags."""
    import torch

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.configs import core_transformer_config_from_args
    from megatron.training.theoretical_memory import count_parameters
    from megatron.training.tokenizer import build_tokenizer

    args = _args(
        megatron_argv(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            seq_length=16,
            max_position_embeddings=24,
            micro_batch_size=1,
            vocab_size=100,
            train_iters=1,
            lr=1e-3,
        )
        + flags
    )
    build_tokenizer(args)
    model = GPTModel(
        config=core_transformer_config_from_args(args),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    )
    built = sum(p.numel() for p in model.parameters())
    assert count_parameters(args, args.padded_vocab_size).total == built
    assert isinstance(built, int) and torch.is_tensor(next(model.parameters()))


def test_own_world_size_flag_is_stripped_before_megatron_parsing(capsys):
    from megatron.training.dry_run import main, split_own_flags

    assert split_own_flags(["--dry-run-world-size", "4", "--num-layers", "2"]) == (
        4,
        ["--num-layers", "2"],
    )
    assert split_own_flags(["--dry-run-world-size=16"]) == (16, [])
    code = main(
        ["--dry-run-world-size", "4"]
        + megatron_argv(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            seq_length=16,
            max_position_embeddings=16,
            micro_batch_size=2,
            global_batch_size=16,
            vocab_size=100,
            train_iters=1,
            lr=None,
            tensor_model_parallel_size=2,
        )
    )
    layout = _layout(capsys.readouterr().out)
    assert code == 0
    assert (
        layout["world size"],
        layout["data parallel size (DP)"],
        layout["micro-batches per step"],
    ) == ("4", "2", "4")
