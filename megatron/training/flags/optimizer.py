"""Flags of the optimizer and its schedule: regularization (weight decay, dropout, Adam,
SGD, Muon, Lion), the learning-rate schedule and the initial weights (seed, muP)."""

from typing import Optional

from megatron.training.flags.spec import flag, flag_group, off_switch, switch


@flag_group("regularization")
class RegularizationFlags:
    attention_dropout: float = flag(
        0.1,
        "Dropout probability on the attention probabilities.",
        honoured_at="TransformerConfig.attention_dropout",
    )
    hidden_dropout: float = flag(
        0.1,
        "Dropout probability on the transformer hidden states.",
        honoured_at="TransformerConfig.hidden_dropout",
    )
    weight_decay: float = flag(
        0.01,
        "Weight decay coefficient (decoupled, AdamW style).",
        honoured_at="OptimizerConfig.weight_decay; model_setup.get_optimizer_param_scheduler",
    )
    start_weight_decay: Optional[float] = flag(
        None,
        "Initial weight decay for a non-constant --weight-decay-incr-style.",
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    end_weight_decay: Optional[float] = flag(
        None,
        "Final weight decay for a non-constant --weight-decay-incr-style.",
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    weight_decay_incr_style: str = flag(
        "constant",
        "How weight decay moves from start to end.",
        choices=["constant", "linear", "cosine"],
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    clip_grad: float = flag(
        1.0,
        "Clip gradients to this global L2 norm (0: no clipping).",
        honoured_at="OptimizerConfig.clip_grad",
    )
    adam_beta1: float = flag(0.9, "Adam beta1.", honoured_at="OptimizerConfig.adam_beta1")
    adam_beta2: float = flag(0.999, "Adam beta2.", honoured_at="OptimizerConfig.adam_beta2")
    adam_eps: float = flag(1e-08, "Adam epsilon.", honoured_at="OptimizerConfig.adam_eps")
    sgd_momentum: float = flag(0.9, "SGD momentum.", honoured_at="OptimizerConfig.sgd_momentum")
    apply_wd_to_qk_layernorm: bool = switch("Apply weight decay to the qk-layernorm weights too.")
    no_weight_decay_cond_type: Optional[str] = flag(
        None,
        "Named rule choosing the parameters without weight decay.",
        choices=["apply_wd_to_qk_layernorm"],
    )
    muon_momentum: float = flag(0.9, "Muon momentum.", honoured_at="OptimizerConfig.muon_momentum")
    muon_split_qkv: bool = off_switch(
        "Orthogonalize the fused QKV weight as one matrix.",
        options="--muon-no-split-qkv",
        honoured_at="OptimizerConfig.muon_split_qkv",
    )
    muon_nesterov: bool = switch(
        "Nesterov momentum in Muon.", honoured_at="OptimizerConfig.muon_nesterov"
    )
    muon_scale_mode: str = flag(
        "spectral",
        "How Muon scales the orthogonalized update.",
        choices=["spectral", "unit_rms_norm", "shape_scaling"],
        honoured_at="OptimizerConfig.muon_scale_mode",
    )
    muon_fp32_matmul_prec: str = flag(
        "medium",
        "fp32 matmul precision of the Newton-Schulz iteration.",
        choices=["low", "medium", "high"],
        honoured_at="OptimizerConfig.muon_fp32_matmul_prec",
    )
    muon_coefficient_type: str = flag(
        "quintic",
        "Newton-Schulz polynomial coefficients.",
        honoured_at="OptimizerConfig.muon_coefficient_type",
    )
    muon_num_ns_steps: int = flag(
        5, "Newton-Schulz iterations.", honoured_at="OptimizerConfig.muon_num_ns_steps"
    )
    muon_tp_mode: str = flag(
        "duplicated",
        "How tensor-parallel shards are orthogonalized.",
        choices=["blockwise", "duplicated", "distributed"],
        honoured_at="OptimizerConfig.muon_tp_mode",
    )
    muon_use_syrk: bool = switch("Use SYRK kernels in the Newton-Schulz iteration.")
    muon_extra_scale_factor: float = flag(
        1.0,
        "Extra factor on the Muon update.",
        honoured_at="OptimizerConfig.muon_extra_scale_factor",
    )
    muon_scalar_optimizer: str = flag(
        "adam",
        "Optimizer of the parameters Muon does not orthogonalize.",
        choices=["adam", "lion"],
        honoured_at="OptimizerConfig.muon_scalar_optimizer",
    )
    lion_beta1: float = flag(0.95, "Lion beta1.", honoured_at="OptimizerConfig.lion_beta1")
    lion_beta2: float = flag(0.98, "Lion beta2.", honoured_at="OptimizerConfig.lion_beta2")


@flag_group("initialization")
class InitializationFlags:
    seed: int = flag(
        1234,
        "Random seed for python, numpy, torch and CUDA.",
        honoured_at="TransformerConfig.init_seed; "
        "pretrain_*.train_valid_test_datasets_provider; "
        "initialize._set_random_seed",
    )
    data_parallel_random_init: bool = switch(
        "Initialize parameters differently on each data-parallel rank.",
        honoured_at="initialize._set_random_seed; model_setup.get_model; "
        "checkpointing_dist.save_checkpoint_dist",
    )
    init_method_std: float = flag(
        0.02,
        "Standard deviation of the normal weight init.",
        honoured_at="TransformerConfig.init_method_std",
    )
    embedding_init_method_std: Optional[float] = flag(
        None,
        "Standard deviation for the embedding init (default: --init-method-std).",
        honoured_at="TransformerConfig.embedding_init_method_std",
    )
    init_method_xavier_uniform: bool = switch(
        "Xavier-uniform weight initialization.", honoured_at="TransformerConfig.init_method"
    )
    te_rng_tracker: bool = switch("Use Transformer Engine's RNG tracker.")
    inference_rng_tracker: bool = switch("Use an RNG tracker configured for inference.")
    use_mup: bool = switch(
        "Maximal-update parametrization (muP) of init, learning rates, outputs.",
        honoured_at="TransformerConfig.use_mup; model_setup.setup_model_and_optimizer",
    )
    mup_width_mult: float = flag(
        1.0,
        "muP width multiplier (default: from --mup-base-hidden-size).",
        honoured_at="TransformerConfig.mup_width_mult; OptimizerConfig.mup_width_mult",
    )
    mup_base_hidden_size: Optional[int] = flag(
        None,
        "muP: hidden size of the base model.",
        honoured_at="TransformerConfig.mup_base_hidden_size",
    )
    mup_embedding_mult: float = flag(
        1.0,
        "muP: multiplier of the embedding output.",
        honoured_at="TransformerConfig.mup_embedding_mult",
    )
    mup_output_mult: float = flag(
        1.0,
        "muP: multiplier of the output logits.",
        honoured_at="TransformerConfig.mup_output_mult",
    )
    mup_base_head_dim: Optional[float] = flag(
        None,
        "muP: head dimension of the base model.",
        honoured_at="TransformerConfig.mup_base_head_dim",
    )
    mup_attn_scale_power: float = flag(
        1.0,
        "muP: attention scores scale as 1/d^power.",
        honoured_at="TransformerConfig.mup_attn_scale_power",
    )


@flag_group(
    "learning rate",
    removed={
        (
            "--override-lr-scheduler",
            "--use-checkpoint-lr-scheduler",
        ): "renamed to --override-opt-param-scheduler / --use-checkpoint-opt-param-scheduler"
    },
)
class LearningRateFlags:
    lr: Optional[float] = flag(
        None,
        "Peak learning rate (after warm-up).",
        honoured_at="OptimizerConfig.lr; model_setup.get_optimizer_param_scheduler",
    )
    lr_decay_style: str = flag(
        "linear",
        "Learning rate decay function.",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    lr_wsd_decay_style: str = flag(
        "exponential",
        "Decay of the WSD annealing phase.",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    lr_decay_iters: Optional[int] = flag(
        None,
        "Iterations to decay over. Default: --train-iters.",
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    lr_decay_samples: Optional[int] = flag(
        None,
        "Samples to decay over. Default: --train-samples.",
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    lr_wsd_decay_samples: Optional[int] = flag(
        None,
        "Samples in the WSD annealing phase.",
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    lr_wsd_decay_iters: Optional[int] = flag(
        None,
        "Iterations in the WSD annealing phase.",
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    lr_warmup_fraction: Optional[float] = flag(
        None,
        "Warm-up length as a fraction of the decay length.",
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    lr_warmup_iters: int = flag(
        0, "Iterations of linear warm-up.", honoured_at="model_setup.get_optimizer_param_scheduler"
    )
    lr_warmup_samples: int = flag(
        0, "Samples of linear warm-up.", honoured_at="model_setup.get_optimizer_param_scheduler"
    )
    lr_warmup_init: float = flag(
        0.0,
        "Learning rate at the start of warm-up.",
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    warmup: Optional[int] = flag(
        None,
        "Removed: use --lr-warmup-fraction, -iters or -samples.",
        honoured_at="rules/deprecated.py: ends with Megatron's hint",
    )
    min_lr: float = flag(
        0.0,
        "Floor of the learning rate.",
        honoured_at="OptimizerConfig.min_lr; model_setup.get_optimizer_param_scheduler",
    )
    override_opt_param_scheduler: bool = switch(
        "Use the scheduler values from the command line, ignoring the checkpoint.",
        options=("--override-opt_param-scheduler", "--override-opt-param-scheduler"),
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    use_checkpoint_opt_param_scheduler: bool = switch(
        "Use the scheduler values stored in the checkpoint.",
        options=("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"),
        honoured_at="model_setup.get_optimizer_param_scheduler",
    )
    decoupled_lr: Optional[float] = flag(
        None,
        "Separate learning rate for the embedding and output layer.",
        honoured_at="OptimizerConfig.decoupled_lr",
    )
    decoupled_min_lr: Optional[float] = flag(
        None, "Minimum of --decoupled-lr.", honoured_at="OptimizerConfig.decoupled_min_lr"
    )
    freeze_all_layers: bool = switch("Train nothing: freeze every parameter.")
