"""The hybrid family's flag checks (pretrain_mamba.py): each bad combination is one line naming
the flag; other families refuse the hybrid flags; FLOPs and parameters follow the pattern."""

import pytest

from megatron.core.models.mamba import MambaModel
from megatron.training.configs import core_transformer_config_from_args
from megatron.training.flag_errors import ArgumentValidationError
from megatron.training.model_families import get_model_family
from tests.unit_tests.tiny_configs import tiny_args

MAMBA = ("--mamba-state-dim", "8", "--mamba-head-dim", "16", "--mamba-num-groups", "2")


def _args(*extra):
    return tiny_args(*MAMBA, "--normalization", "RMSNorm", *extra)


@pytest.mark.parametrize(
    "extra, message",
    [
        ((), "needs --hybrid-override-pattern"),
        (("--hybrid-override-pattern", "M*M"), "has 3 layers but --num-layers is 4"),
        (("--hybrid-override-pattern", "M*MX"), "unknown layer symbol 'X'"),
        (("--hybrid-override-pattern", "M*-E"), "has E \\(MoE\\) but no --num-experts"),
        (
            ("--hybrid-override-pattern", "M*-M", "--hybrid-layer-pattern", "MM-M"),
            "differ; give one",
        ),
        (("--hybrid-override-pattern", "M*-M", "--mamba-num-groups", "3"), "--mamba-num-groups"),
    ],
)
def test_bad_hybrid_flags_are_one_line(extra, message):
    args = _args(*extra)
    with pytest.raises(ArgumentValidationError, match=message):
        get_model_family("mamba").check_args(args)


# Megatron's rules for Mamba under context parallelism (its MambaContextParallel checks): each
# CP rank gets whole heads, and whole groups or an equal share of one group's heads.
CP_HEADS = ("--mamba-num-heads", "12")


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        (("--context-parallel-size", "16"), 16, r"heads \(8\) must be divisible by --tensor-m"),
        (
            ("--context-parallel-size", "8", "--tensor-model-parallel-size", "2"),
            16,
            r"\(8\) must be divisible by --tensor-model-parallel-size x --context-parallel-siz"
            r"e \(2 x 8\)",
        ),
        (
            CP_HEADS + ("--mamba-num-groups", "3", "--context-parallel-size", "4"),
            4,
            r"--context-parallel-size \(4\) must be divisible by --mamba-num-groups",
        ),
        (
            CP_HEADS + ("--mamba-num-groups", "3", "--context-parallel-size", "2"),
            2,
            r"--mamba-num-groups \(3\) must be divisible by --tensor-model-parallel-size x --c",
        ),
    ],
)
def test_bad_mamba_context_parallel_sizes_are_one_line(extra, world_size, message):
    args = tiny_args(
        *MAMBA,
        "--normalization",
        "RMSNorm",
        "--hybrid-override-pattern",
        "M*-M",
        *extra,
        world_size=world_size,
    )
    with pytest.raises(ArgumentValidationError, match=message) as caught:
        get_model_family("mamba").check_args(args)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("tp, cp", [(1, 2), (2, 2), (1, 4), (2, 4)])
def test_mamba_context_parallel_sizes_megatron_accepts(tp, cp):
    # 8 heads in 2 groups: CP ranks get whole groups (TP1 CP2) or share one (the others).
    args = tiny_args(
        *MAMBA,
        "--normalization",
        "RMSNorm",
        "--hybrid-override-pattern",
        "M*-M",
        "--context-parallel-size",
        str(cp),
        "--tensor-model-parallel-size",
        str(tp),
        world_size=tp * cp,
    )
    get_model_family("mamba").check_args(args)


def test_gpt_refuses_the_hybrid_pattern():
    args = _args("--hybrid-override-pattern", "M*-M")
    with pytest.raises(ArgumentValidationError, match="read by pretrain_mamba.py only"):
        get_model_family("gpt").check_args(args)


def test_parameter_count_and_flops_follow_the_pattern():
    spec = get_model_family("mamba")
    args = _args("--hybrid-override-pattern", "M*-M")
    spec.check_args(args)
    args.padded_vocab_size = 128  # set by the tokenizer's build in a run
    config = core_transformer_config_from_args(args)
    model = MambaModel(
        config,
        vocab_size=128,
        max_sequence_length=args.max_position_embeddings,
        hybrid_override_pattern="M*-M",
        position_embedding_type="rope",
    )
    layers = sum(p.numel() for p in model.decoder.layers.parameters())
    count = spec.count_parameters(args, 128)
    assert count.per_layer == layers // 4
    assert count.per_layer * 4 + count.layers_remainder == layers  # exact, not the mean x 4
    assert spec.num_floating_point_operations(args, 2) > 0
    mlp_only = _args("--hybrid-override-pattern=----")
    mlp_only.padded_vocab_size = 128
    assert spec.num_floating_point_operations(mlp_only, 2) != spec.num_floating_point_operations(
        args, 2
    )
