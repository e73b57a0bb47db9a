"""Megatron's ``MambaModel``: a hybrid Mamba / attention / MLP / MoE language model."""

from typing import Optional

import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.ssm.mamba_block import MambaStack
from megatron.core.ssm.mamba_hybrid_layer_allocation import hybrid_block_spec, layer_symbols
from megatron.core.transformer.spec_utils import ModuleSpec


class MambaModel(GPTModel):
    """embedding -> decoder (:class:`MambaStack` of the layers of ``hybrid_override_pattern``)
    -> output_layer, with :class:`GPTModel`'s embedding, output layer, loss, pipeline and
    generation behaviour. State dict: ``decoder.layers.N.{norm, mixer.{in_proj, conv1d, dt_bias,
    A_log, D, norm, out_proj}}`` for a Mamba layer, ``input_layernorm`` / ``self_attention`` for
    an attention layer, ``pre_mlp_layernorm`` / ``mlp`` for an MLP or MoE layer, and
    ``decoder.final_norm``. Position embeddings default to none (Megatron's default here)."""

    block_class = MambaStack

    def __init__(
        self,
        config,
        mamba_stack_spec=None,
        vocab_size: int = 0,
        max_sequence_length: int = 0,
        pre_process: bool = True,
        hybrid_override_pattern: Optional[str] = None,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "none",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None,
        pg_collection=None,
        vp_stage: Optional[int] = None,
    ):
        if not hybrid_override_pattern:
            raise ValueError("MambaModel needs hybrid_override_pattern (--hybrid-override-pattern)")
        count = len(layer_symbols(hybrid_override_pattern))
        if count != config.num_layers:
            raise ValueError(
                f"--hybrid-override-pattern {hybrid_override_pattern!r} has {count} layers but "
                f"--num-layers is {config.num_layers}"
            )
        self.hybrid_override_pattern = hybrid_override_pattern
        if isinstance(mamba_stack_spec, ModuleSpec) and issubclass(
            mamba_stack_spec.module, MambaStack
        ):
            mamba_stack_spec = None  # megatron-core's mamba_stack_spec: the layers of the pattern
        super().__init__(
            config,
            mamba_stack_spec or hybrid_block_spec(hybrid_override_pattern),
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            fp16_lm_cross_entropy=fp16_lm_cross_entropy,
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
            rotary_percent=rotary_percent,
            rotary_base=rotary_base,
            scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )

    def _activation_dtype(self) -> torch.dtype:
        for param in self.decoder.parameters():
            return param.dtype
        return self.config.params_dtype
