"""The core plugins' hybrid (``--model-type MAMBA``) side: a trainer checkpoint of
``pretrain_mamba.py`` read into, and written from, the messages of ``protocol_hybrid.py``."""

from __future__ import annotations

import copy

from protocol import ConversionError, put_metadata
from protocol_hybrid import hybrid_args_of, send_hybrid_model


def is_hybrid(a) -> bool:
    return bool(
        getattr(a, "hybrid_layer_pattern", None) or getattr(a, "hybrid_override_pattern", None)
    )


def hybrid_metadata_from_args(a, metadata_from_args, *rest):
    """``loader_core.metadata_from_args`` for a hybrid checkpoint: the GPT fields of its args,
    then the pattern, the squared ReLU and the MoE layers' settings."""
    plain = copy.copy(a)
    plain.squared_relu, plain.num_experts = False, None  # judged here, not as a GPT model
    md = metadata_from_args(plain, *rest)
    md.model_type = "MAMBA"
    md.checkpoint_args = a
    md.hybrid_override_pattern = a.hybrid_layer_pattern or a.hybrid_override_pattern
    md.hybrid_args = hybrid_args_of(a)
    if getattr(a, "squared_relu", False):
        md.activation = "squared_relu"
    md.num_experts = getattr(a, "num_experts", None)
    md.moe_router_topk = getattr(a, "moe_router_topk", None)
    if md.num_experts and getattr(a, "swiglu", False):
        raise ConversionError("hybrid checkpoints with SwiGLU experts are not converted yet")
    return md


def load_hybrid(queue, reader, md, alive=None) -> None:
    put_metadata(queue, md, alive)
    names = reader.names()

    def layer_names(i):
        prefix = f"decoder.layers.{i}."
        return [n[len(prefix) :] for n in names if n.startswith(prefix)]

    send_hybrid_model(queue, md, reader.tensor, layer_names, alive)


def check_trainer_args(margs) -> None:
    """pretrain_mamba.py's own checks of the written args (pattern, Mamba sizes against TP)."""
    from megatron.training.flag_errors import ArgumentValidationError
    from megatron.training.model_families.mamba import check_args

    try:
        check_args(margs)
    except ArgumentValidationError as exc:
        raise ConversionError(
            f"the converted model does not fit pretrain_mamba.py: {exc}"
        ) from None
