"""Post-training flags: reinforcement learning (GRPO) and logits distillation."""

from typing import List, Optional

from megatron.training.flags.spec import flag, flag_group, switch, toggle


@flag_group("rl")
class RLFlags:
    perform_rl_step: bool = switch(
        "Train with reinforcement learning (GRPO) instead of pretraining."
    )
    rl_prompts_per_eval: int = flag(32, "Prompts per evaluation.")
    grpo_prompts_per_step: int = flag(32, "Prompts per GRPO step.")
    grpo_group_size: int = flag(2, "Rollouts per prompt.")
    rl_generation_lag: Optional[float] = flag(
        None, "How many steps rollouts may lag the trained policy."
    )
    rl_max_inflight_requests: Optional[int] = flag(None, "Generation requests in flight at once.")
    rl_submission_granularity: str = flag(
        "B",
        "Rollouts are submitted per request (R), group (G) or batch (B).",
        choices=["R", "G", "B"],
    )
    rl_consumption_granularity: str = flag(
        "B",
        "Rollouts are consumed per request (R), group (G) or batch (B).",
        choices=["R", "G", "B"],
    )
    rl_durable_rollout_bank: bool = switch("Keep the rollouts on disk.")
    rl_rollout_bank_dir: Optional[str] = flag(None, "Directory of the durable rollout bank.")
    rl_rollout_bank_max_bytes: int = flag(0, "Size limit of the rollout bank (0: none).")
    langrl_env_config: Optional[str] = flag(None, "Environment configuration file.")
    rl_default_temperature: float = flag(1.0, "Sampling temperature of the rollouts.")
    rl_default_top_p: float = flag(0, "Top-p of the rollouts (0: off).")
    rl_default_top_k: int = flag(-1, "Top-k of the rollouts (-1: off).")
    rl_partial_rollouts: bool = toggle(False, "Continue unfinished rollouts in the next step.")
    rl_use_sequence_packing: bool = toggle(
        False, "Pack rollouts into training sequences.", type=bool
    )
    rl_sequence_packing_max_sequences_per_bin: int = flag(
        50, "Rollouts packed into one sequence at most."
    )
    rl_sequence_packing_algo: str = flag(
        "fifo", "How rollouts are packed.", choices=["fifo", "round-robin"]
    )
    rl_skip_bos_token: bool = toggle(False, "Drop the BOS token from the rollouts.", type=bool)
    rl_profile: bool = switch("Profile the RL loop.")
    rl_profile_dir: Optional[str] = flag(None, "Where the RL profiles are written.")
    rl_inference_parsers: List[str] = flag(
        [], "Parsers of the model outputs.", type=None, nargs="*"
    )
    grpo_iterations: int = flag(2, "Optimizer passes over each batch of rollouts.")
    grpo_clamp_eps_lower: float = flag(0.01, "Lower clamp of the policy ratio.")
    grpo_clamp_eps_upper: float = flag(0.01, "Upper clamp of the policy ratio.")
    grpo_kl_beta: float = flag(0.001, "Weight of the KL penalty.")
    grpo_entropy_term_weight: float = flag(0.0, "Weight of the entropy bonus.")
    grpo_filter_groups_with_same_reward: bool = switch(
        "Drop groups whose rollouts all got the same reward."
    )
    rl_inference_logprobs_is_correction: bool = toggle(
        False, "Correct for the inference engine's log-probabilities.", type=bool
    )
    rl_importance_sampling_truncation_coef: Optional[float] = flag(
        None, "Truncation of the importance-sampling weights."
    )
    rl_offload_optimizer_during_inference: bool = switch(
        "Move the optimizer state to the CPU while rollouts are generated."
    )
    rl_kv_cache_management_mode: str = flag(
        "persist",
        "What happens to the KV cache between generation phases.",
        choices=["persist", "offload", "recompute"],
    )
    rl_persist_cuda_graphs: bool = toggle(
        False, "Keep the inference CUDA graphs between phases.", type=bool
    )
    rl_training_cuda_graphs: bool = toggle(False, "CUDA graphs for the training steps.", type=bool)
    rl_inference_tensor_model_parallel_size: Optional[int] = flag(
        None, "Tensor parallelism of the inference model."
    )
    rl_inference_pipeline_model_parallel_size: Optional[int] = flag(
        None, "Pipeline parallelism of the inference model."
    )
    rl_inference_expert_model_parallel_size: Optional[int] = flag(
        None, "Expert parallelism of the inference model."
    )
    rl_inference_expert_tensor_model_parallel_size: Optional[int] = flag(
        None, "Expert tensor parallelism of the inference model."
    )
    rl_inference_model_unified_memory_level: int = flag(
        0, "Keep the inference model in CUDA unified memory (1) or not (0).", choices=[0, 1]
    )
    rl_offload_inference_model_weights_when_idle: bool = toggle(
        False, "Move the inference model's weights to the CPU while it is idle."
    )
    refit_method: str = flag(
        "gloo",
        "How the trained weights reach the inference model.",
        choices=["nccl", "gloo", "nvshmem"],
    )
    rl_verify_model_weights_swap: bool = toggle(
        False, "Check the inference model's weights after each refit."
    )


@flag_group("Logits Distillation")
class LogitsDistillationFlags:
    logits_save_top_k: Optional[int] = flag(None, "Save the top-k logits of each token.")
    logits_save_top_p: Optional[float] = flag(None, "Save the logits within this top-p mass.")
    logits_save_top_p_min_k: int = flag(
        1, "Logits saved at least per token with --logits-save-top-p."
    )
    logits_save_dir: Optional[str] = flag(None, "Directory the teacher logits are written to.")
    logits_save_dtype: str = flag(
        "fp16", "Dtype of the saved logits.", choices=["fp16", "bf16", "fp32"]
    )
    logits_load_dir: Optional[str] = flag(None, "Directory of teacher logits to distil from.")
    logits_load_decode_threads: int = flag(4, "Threads decoding the loaded logits.")
    logits_load_prefetch_factor: int = flag(3, "Batches of logits prefetched.")
    logits_load_msc_prefetch_depth: int = flag(2, "Prefetch depth of the multi-storage client.")
    logits_load_kd_loss_alpha: float = flag(1.0, "Weight of the distillation loss.")
    logits_load_ignore_errors: bool = switch("Skip batches whose logits cannot be read.")
