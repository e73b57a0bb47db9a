"""The flag policy table (megatron/training/flags/policy.py): every flag of the parser is
honoured, has no effect here (speed only) or is refused, and each class behaves as promised.

* refused: validation ends with one line naming the flag and why (every refused row is tried);
* no effect here: the run is accepted and the start-up note names the flag and why (every row);
* honoured: the flag reaches what it controls (a representative set, compared with the value
  given on the command line), and is neither refused nor in the note.
"""

import argparse
import signal

import pytest

from megatron.core.transformer.enums import AttnBackend
from megatron.training import flag_policy
from megatron.training.arguments import (
    ArgumentValidationError,
    add_megatron_arguments,
    parse_and_validate_args,
    parse_args,
    validate_args,
)
from megatron.training.flag_policy import HONOURED, NO_EFFECT, REFUSED
from megatron.training.flags import POLICY

BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--max-position-embeddings",
    "256",
    "--seq-length",
    "128",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "128",
    "--transformer-impl",
    "local",
]


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def _actions():
    return flag_policy.megatron_actions()


_PARSERS = {}


def _parsed(argv):
    """parse_args for one process, with the parser built once (it has 838 options)."""
    if "parser" not in _PARSERS:
        _PARSERS["parser"] = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = _PARSERS["parser"].parse_args(BASE + list(argv))
    args.rank, args.world_size = 0, 1
    return args


def _validated(argv, world_size=1):
    if world_size == 1:
        return validate_args(_parsed(argv))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", str(world_size))
        return validate_args(parse_args(argv=BASE + list(argv)))


# A value that counts as given, for rows whose rule refuses or ignores only some values, and
# companion flags for rows that a validation rule ties to others.
SPECIAL_VALUES = {
    "optimizer": ["--optimizer", "soap"],
    "ckpt_format": ["--ckpt-format", "torch_dcp", "--save", "ckpt", "--save-interval", "5"],
    "async_save": ["--async-save", "--ckpt-format", "torch"],
    "position_embedding_type": ["--position-embedding-type", "relative"],
    "rope_type": ["--rope-type", "yarn"],
    "dataloader_type": ["--dataloader-type", "external"],
    "tokenizer_type": ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "t.json"],
    "rerun_mode": ["--rerun-mode", "report_stats"],
    "mrope_section": ["--mrope-section", "2", "2"],
    "expert_tensor_parallel_size": ["--expert-tensor-parallel-size", "2"],
    "expert_model_parallel_size": ["--expert-model-parallel-size", "2", "--num-experts", "4"],
    "log_memory_interval": ["--log-memory-interval", "200"],
    "mtp_num_layers": ["--mtp-num-layers", "1", "--position-embedding-type", "rope"],
    "inprocess_active_world_size": ["--inprocess-active-world-size", "3"],
    "non_persistent_ckpt_type": [
        "--non-persistent-ckpt-type",
        "local",
        "--non-persistent-local-ckpt-dir",
        "d",
    ],
    "fp8_param_gather": ["--fp8-param-gather", "--use-distributed-optimizer"],
    "load_main_params_from_ckpt": ["--load-main-params-from-ckpt", "--no-load-optim"],
    "optimizer_cpu_offload": ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"],
    "tp_comm_overlap": [
        "--tp-comm-overlap",
        "--sequence-parallel",
        "--tensor-model-parallel-size",
        "2",
    ],
    "overlap_param_gather_with_optimizer_step": [
        "--overlap-param-gather-with-optimizer-step",
        "--overlap-param-gather",
        "--overlap-grad-reduce",
        "--use-distributed-optimizer",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--global-batch-size",
        "8",
    ],
    "cp_comm_type": ["--cp-comm-type", "a2a"],
    # The DDP bucket flags have no effect under FSDP2 (no buckets there; Megatron-FSDP's
    # default strategy, optim_grads_params, runs on FSDP2).
    "overlap_grad_reduce": [
        "--overlap-grad-reduce",
        "--use-torch-fsdp2",
        "--no-gradient-accumulation-fusion",
    ],
    "overlap_param_gather": [
        "--overlap-param-gather",
        "--overlap-grad-reduce",
        "--use-megatron-fsdp",
        "--ckpt-format",
        "fsdp_dtensor",
    ],
    "ddp_bucket_size": [
        "--ddp-bucket-size",
        "1000",
        "--use-torch-fsdp2",
        "--no-gradient-accumulation-fusion",
    ],
    "ddp_num_buckets": [
        "--ddp-num-buckets",
        "2",
        "--use-torch-fsdp2",
        "--no-gradient-accumulation-fusion",
    ],
    "overlap_moe_expert_parallel_comm": [
        "--overlap-moe-expert-parallel-comm",
        "--expert-model-parallel-size",
        "2",
        "--num-experts",
        "4",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--bf16",
    ],
    "delay_wgrad_compute": [
        "--delay-wgrad-compute",
        "--overlap-moe-expert-parallel-comm",
        "--expert-model-parallel-size",
        "2",
        "--num-experts",
        "4",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--bf16",
    ],
    "cuda_graph_impl": ["--cuda-graph-impl", "transformer_engine"],
    "cross_entropy_fusion_impl": ["--cross-entropy-fusion-impl", "te"],
    "transformer_impl": ["--transformer-impl", "transformer_engine"],
    "gradient_accumulation_fusion": ["--no-gradient-accumulation-fusion"],
    "main_grads_dtype": ["--main-grads-dtype", "bf16"],
    "moe_router_load_balancing_type": ["--moe-router-load-balancing-type", "quantile_balancing"],
    "moe_token_dispatcher_type": ["--moe-token-dispatcher-type", "flex"],
}
# World sizes the companion flags above need.
WORLD = {
    "tp_comm_overlap": 2,
    "overlap_param_gather_with_optimizer_step": 4,
    "expert_tensor_parallel_size": 2,
    "expert_model_parallel_size": 2,
    "overlap_moe_expert_parallel_comm": 2,
    "delay_wgrad_compute": 2,
}
# Validation rules refuse these combinations first, with their own message (torch_dcp needs
# FSDP2, which cannot save yet): the policy row is checked on the parsed flags alone.
CHECKED_BEFORE_THE_RULES = {"ckpt_format"}


def _given_argv(dest):
    """Flags giving `dest` a value its rule applies to."""
    if dest in SPECIAL_VALUES:
        return SPECIAL_VALUES[dest]
    action = _actions()[dest]
    flag = flag_policy.flag_of(action)
    if action.nargs == 0:  # store_true / store_false / --x of --x/--no-x
        return [flag]
    if action.choices is not None:
        choice = next(c for c in action.choices if c != action.default)
        return [flag, getattr(choice, "name", str(choice))]
    if action.type is not None and action.type.__name__.endswith("freq_type"):
        value = ["3"]
    elif action.type is not None and action.type.__name__ == "tuple_type":
        value = ["128,0"]
    elif action.type is int or action.type is float:
        value = [str(int(action.default or 0) + 3)]
    else:
        value = ["x"]
    return [flag] + value


def _rows(kind):
    return sorted(dest for dest, rule in POLICY.items() if rule.kind == kind)


def test_every_flag_has_exactly_one_row_and_every_row_a_flag():
    dests = set(_actions())
    assert set(POLICY) == dests
    assert {rule.kind for rule in POLICY.values()} == {HONOURED, NO_EFFECT, REFUSED}
    assert all(rule.reason and rule.dest == dest for dest, rule in POLICY.items())


def test_default_run_is_neither_refused_nor_noted():
    args = _validated([])
    assert args.no_effect_note is None


@pytest.mark.parametrize("dest", _rows(REFUSED))
def test_refused_flags_end_with_their_line(dest):
    argv = _given_argv(dest)
    if dest in CHECKED_BEFORE_THE_RULES:
        message = flag_policy.refusal(_parsed(argv))
    else:
        with pytest.raises(ArgumentValidationError) as info:
            _validated(argv, WORLD.get(dest, 1))
        message = str(info.value)
    flag = flag_policy.flag_of(_actions()[dest])
    assert message.startswith("not supported yet: "), message
    assert f"{flag}" in message and f"({POLICY[dest].reason})" in message, message
    assert "\n" not in message


@pytest.mark.parametrize("dest", _rows(NO_EFFECT))
def test_no_effect_flags_are_accepted_and_named_in_the_note(dest):
    args = _validated(_given_argv(dest), WORLD.get(dest, 1))
    flag = flag_policy.flag_of(_actions()[dest])
    note = args.no_effect_note or ""
    assert note.startswith("no effect here (speed only): "), note
    assert flag in note and POLICY[dest].reason in note, note
    assert "\n" not in note


def _core_configs(args):
    from megatron.training.configs import (
        core_transformer_config_from_args,
        ddp_config_from_args,
        optimizer_config_from_args,
    )

    return (
        core_transformer_config_from_args(args),
        optimizer_config_from_args(args),
        ddp_config_from_args(args),
    )


# (flags, where the value must arrive: a function of (args, transformer, optimizer, ddp config))
HONOURED_CASES = [
    (["--norm-epsilon", "1e-3"], lambda a, t, o, d: t.layernorm_epsilon == 1e-3),
    (["--apply-layernorm-1p"], lambda a, t, o, d: t.layernorm_zero_centered_gamma is True),
    (["--attention-backend", "unfused"], lambda a, t, o, d: t.attention_backend == "unfused"),
    (["--use-flash-attn"], lambda a, t, o, d: t.attention_backend == "flash"),
    (["--disable-bias-linear"], lambda a, t, o, d: t.add_bias_linear is False),
    (["--hidden-dropout", "0.25"], lambda a, t, o, d: t.hidden_dropout == 0.25),
    (["--init-method-std", "0.05"], lambda a, t, o, d: t.init_method_std == 0.05),
    (["--adam-beta2", "0.95"], lambda a, t, o, d: o.adam_beta2 == 0.95),
    (["--clip-grad", "0.5"], lambda a, t, o, d: o.clip_grad == 0.5),
    (["--overlap-grad-reduce"], lambda a, t, o, d: d.overlap_grad_reduce is True),
    (["--exit-signal", "SIGUSR2"], lambda a, t, o, d: a.exit_signal is signal.SIGUSR2),
    (["--swiglu"], lambda a, t, o, d: t.gated_linear_unit is True),
    (["--qk-layernorm"], lambda a, t, o, d: t.qk_layernorm is True),
    (
        ["--moe-router-score-function", "sqrtsoftplus", "--num-experts", "4"],
        lambda a, t, o, d: t.moe_router_score_function == "sqrtsoftplus",
    ),
    (
        ["--moe-router-load-balancing-type", "global_aux_loss", "--num-experts", "4"],
        lambda a, t, o, d: t.moe_router_load_balancing_type == "global_aux_loss",
    ),
]


@pytest.mark.parametrize("argv, arrived", HONOURED_CASES, ids=[c[0][0] for c in HONOURED_CASES])
def test_honoured_flags_reach_what_they_control(argv, arrived):
    args = _validated(argv)
    assert arrived(args, *_core_configs(args))
    assert argv[0] not in (args.no_effect_note or "")
    default = _validated([])
    assert not arrived(default, *_core_configs(default)), "the case must differ from the default"


def test_no_data_sharding_reaches_the_cyclic_sampler():
    from megatron.training.data_samplers import build_pretraining_data_loader

    def sampler_of(*argv):
        args = _validated(["--dataloader-type", "cyclic", "--num-workers", "0", *argv])
        return build_pretraining_data_loader(list(range(40)), 0, args, 1, 2).batch_sampler

    assert sampler_of().data_sharding is True
    assert sampler_of("--no-data-sharding").data_sharding is False


def test_logging_level_sets_the_root_logger():
    import logging

    from megatron.training.initialize import _apply_process_settings

    root = logging.getLogger()
    before = root.level
    try:
        _apply_process_settings(_validated(["--logging-level", "40"]))
        assert root.level == 40
    finally:
        root.setLevel(before)


def test_value_dependent_rules_honour_the_other_values():
    """--optimizer sgd, --position-embedding-type rope, ... are honoured; only the values their
    rule names are refused."""
    args = _validated(
        [
            "--optimizer",
            "sgd",
            "--position-embedding-type",
            "rope",
            "--dataloader-type",
            "cyclic",
            "--recompute-activations",
            "--recompute-modules",
            "core_attn",
            "mlp",
            "--cp-comm-type",
            "p2p",
        ]
    )
    assert args.optimizer == "sgd" and args.no_effect_note is None


def test_refusal_lists_every_offender_on_one_line(capsys):
    with pytest.raises(SystemExit, match="^2$"):
        parse_and_validate_args(
            argv=BASE + ["--moe-use-upcycling", "--use-pytorch-profiler", "--sft"]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: not supported yet: --moe-use-upcycling (")
    assert err[0].count("; ") == 2 and "--use-pytorch-profiler (" in err[0] and "--sft (" in err[0]


def test_help_names_the_class_of_refused_and_no_effect_flags(capsys):
    with pytest.raises(SystemExit, match="^0$"):
        parse_args(argv=["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--moe-use-upcycling Convert a dense checkpoint" in text
    assert f"[not supported yet: {POLICY['moe_use_upcycling'].reason}]" in text
    assert f"[no effect here, speed only: {POLICY['nccl_ub'].reason}]" in text
    assert f"[not supported yet (some values): {POLICY['optimizer'].reason}]" in text
    start = text.index("--seed SEED Random seed")
    assert "[" not in text[start : text.index("--", start + 3)]  # honoured: no class label


def test_no_effect_note_is_judged_on_what_the_user_gave():
    """Validation turns RoPE fusion off for learned positions; that is not the user's
    --no-rope-fusion and must not be reported as one."""
    args = _validated([])
    assert args.apply_rope_fusion is False and args.no_effect_note is None
    assert "--no-rope-fusion (" in _validated(["--no-rope-fusion"]).no_effect_note


def test_attn_backend_is_an_enum_like_megatrons():
    assert _validated([]).attention_backend is AttnBackend.auto
    assert isinstance(parse_args(argv=[]).exit_signal, signal.Signals)


def test_rules_of_the_part_a_flags(capsys):
    interval = "--check-weight-hash-across-dp-replicas-interval"
    with pytest.raises(ArgumentValidationError, match=f"^{interval} must be > 0 \\(got 0\\)$"):
        _validated([interval, "0"])
    with pytest.raises(ArgumentValidationError, match=f"^{interval} cannot be used with FSDP2"):
        _validated(
            [interval, "5", "--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]
            + ["--untie-embeddings-and-output-weights"]
        )
    _validated(["--log-progress"])
    assert "WARNING: --log-progress writes progress.txt into --save, which is not set" in (
        capsys.readouterr().out
    )
