"""Tiny configurations shared by the tests: Megatron argument namespaces, TransformerConfigs
and GPT models small enough for a CPU test (their command lines come from tests/harness/argv.py).

One module, so that a config field renamed is fixed in one place. Each builder takes
overrides; a test states the values it relies on, not the defaults here.
"""

import torch

from tests.harness.argv import megatron_argv

# Vocabulary and sequence length of tiny_gpt_model.
TINY_VOCAB = 61
TINY_SEQ = 12


def tiny_argv(*extra, drop=()):
    """tests/harness/argv.TINY as a command line, without the flags in ``drop`` (their
    spellings, ``"--mock-data"``), then ``extra``."""
    return megatron_argv(*extra, **{flag[2:].replace("-", "_"): None for flag in drop})


def validated_args(argv, world_size=1, rank=0, defaults=None):
    """parse_args + validate_args of ``argv`` as rank ``rank`` of ``world_size`` processes (the
    environment's RANK/WORLD_SIZE are not read)."""
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(argv=[str(a) for a in argv])
    args.world_size, args.rank = world_size, rank
    return validate_args(args, defaults)


def tiny_args(*extra, world_size=1, rank=0, drop=(), defaults=None):
    """The validated arguments of ``tiny_argv(*extra, drop=drop)``."""
    return validated_args(tiny_argv(*extra, drop=drop), world_size, rank, defaults)


def megatron_args(**overrides):
    """The arguments of a command line without flags (every flag at its Megatron default), with
    ``overrides`` set on top: code that starts reading another flag still finds it here, unlike in
    a hand-written ``argparse.Namespace``."""
    from megatron.training.arguments import parse_args

    args = parse_args(argv=[])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def tiny_transformer_config(**overrides):
    """A 2-layer, 32-wide, 4-head TransformerConfig without dropout."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def tiny_gpt_model(config=None, seed=0, **model_kwargs):
    """A GPTModel of ``config`` (tiny_transformer_config() by default), initialized from
    ``seed``, with TINY_VOCAB tokens and TINY_SEQ positions unless given."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import ProcessGroupCollection

    torch.manual_seed(seed)
    config = config or tiny_transformer_config()
    model_kwargs.setdefault("vocab_size", TINY_VOCAB)
    model_kwargs.setdefault("max_sequence_length", TINY_SEQ)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    if model_kwargs.get("pg_collection") is None:
        # One process unless groups are given (GPTModel would take the current parallel_state's).
        model_kwargs["pg_collection"] = ProcessGroupCollection()
    return GPTModel(config, spec, **model_kwargs)
