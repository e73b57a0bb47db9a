"""Mixed-precision flags: fp16/bf16, loss scaling, fp32 residuals and softmax."""

from typing import Optional

from megatron.training.flags.spec import flag, flag_group, switch


@flag_group("mixed precision")
class MixedPrecisionFlags:
    fp16: bool = switch(
        "Train in fp16 with loss scaling.",
        honoured_at="TransformerConfig.fp16; OptimizerConfig.fp16; model_setup.get_model",
    )
    bf16: bool = switch(
        "Train in bfloat16.",
        honoured_at="TransformerConfig.bf16; OptimizerConfig.bf16; model_setup.get_model",
    )
    grad_reduce_in_bf16: bool = switch(
        "Reduce gradients in bfloat16.",
        honoured_at="rules/precision.py -> accumulate_allreduce_grads_in_fp32 off",
    )
    loss_scale: Optional[float] = flag(
        None,
        "Static loss scale (power of 2); None: dynamic scaling.",
        honoured_at="OptimizerConfig.loss_scale",
    )
    initial_loss_scale: float = flag(
        4294967296, "Initial dynamic loss scale.", honoured_at="OptimizerConfig.initial_loss_scale"
    )
    min_loss_scale: float = flag(
        1.0, "Minimum dynamic loss scale.", honoured_at="OptimizerConfig.min_loss_scale"
    )
    loss_scale_window: float = flag(
        1000,
        "Clean steps before the dynamic scale grows.",
        honoured_at="OptimizerConfig.loss_scale_window",
    )
    hysteresis: int = flag(
        2,
        "Overflow steps tolerated before the dynamic scale shrinks.",
        honoured_at="OptimizerConfig.hysteresis",
    )
    fp32_residual_connection: bool = switch(
        "Keep the residual stream in fp32.",
        honoured_at="TransformerConfig.fp32_residual_connection; "
        "core.pipeline_parallel.p2p_communication.get_pipeline_dtype; "
        "tools.run_text_generation_server._serve",
    )
    apply_query_key_layer_scaling: bool = switch(
        "Scale Q.K^T by 1/layer-number (fp16 aid); implies --attention-softmax-in-fp32.",
        honoured_at="TransformerConfig.apply_query_key_layer_scaling",
    )
    attention_softmax_in_fp32: bool = switch(
        "Compute attention masking and softmax in fp32.",
        honoured_at="TransformerConfig.attention_softmax_in_fp32",
    )
    accumulate_allreduce_grads_in_fp32: bool = switch(
        "Accumulate and all-reduce gradients in fp32 (always on with --bf16).",
        honoured_at="DistributedDataParallelConfig.grad_reduce_in_fp32",
    )
    fp16_lm_cross_entropy: bool = switch(
        "Compute the LM cross entropy in fp16.",
        honoured_at="pretrain_*.model_provider; core.models.common.language_module.LanguageModule",
    )
    logit_dtype: Optional[str] = flag(
        None,
        "Dtype of the output logits (default: the model's).",
        options="--output-logit-dtype",
        choices=["bf16", "fp32"],
    )
    disable_bf16_reduced_precision_matmul: bool = switch(
        "Keep bf16 matmuls from reducing in lower precision.",
        honoured_at="initialize._apply_process_settings",
    )
    reuse_grad_buf_for_mxfp8_param_ag: bool = switch(
        "Reuse the gradient buffer for the mxfp8 parameter all-gather."
    )
    mamba_training_ssm_states_dtype: Optional[str] = flag(
        None, "Dtype of the Mamba SSM states in training.", choices=["fp32", "bf16"]
    )
