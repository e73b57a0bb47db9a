"""Post-training flags: reinforcement learning (GRPO: rollouts, the GRPO loss, the inference
model that generates the rollouts and how its weights are refreshed) and logits distillation."""

from .builder import ArgGroup

_GRANULARITY = ["R", "G", "B"]  # request, group, batch


def _add_rl_args(parser):
    g = ArgGroup(parser, "rl")
    _rollouts(g)
    _grpo(g)
    _inference_model(g)
    return parser


def _rollouts(g):
    g.true("--perform-rl-step", "Train with reinforcement learning (GRPO) instead of pretraining.")
    g.int("--rl-prompts-per-eval", 32, "Prompts per evaluation.")
    g.int("--grpo-prompts-per-step", 32, "Prompts per GRPO step.")
    g.int("--grpo-group-size", 2, "Rollouts per prompt.")
    g.float("--rl-generation-lag", None, "How many steps rollouts may lag the trained policy.")
    g.int("--rl-max-inflight-requests", None, "Generation requests in flight at once.")
    g.str(
        "--rl-submission-granularity",
        "B",
        "Rollouts are submitted per request (R), group (G) or batch (B).",
        choices=_GRANULARITY,
    )
    g.str(
        "--rl-consumption-granularity",
        "B",
        "Rollouts are consumed per request (R), group (G) or batch (B).",
        choices=_GRANULARITY,
    )
    g.true("--rl-durable-rollout-bank", "Keep the rollouts on disk.")
    g.str("--rl-rollout-bank-dir", None, "Directory of the durable rollout bank.")
    g.int("--rl-rollout-bank-max-bytes", 0, "Size limit of the rollout bank (0: none).")
    g.str("--langrl-env-config", None, "Environment configuration file.")
    g.float("--rl-default-temperature", 1.0, "Sampling temperature of the rollouts.")
    g.float("--rl-default-top-p", 0, "Top-p of the rollouts (0: off).")
    g.int("--rl-default-top-k", -1, "Top-k of the rollouts (-1: off).")
    g.both("--rl-partial-rollouts", False, "Continue unfinished rollouts in the next step.")
    g.both("--rl-use-sequence-packing", False, "Pack rollouts into training sequences.", type=bool)
    g.int(
        "--rl-sequence-packing-max-sequences-per-bin",
        50,
        "Rollouts packed into one sequence at most.",
    )
    g.str(
        "--rl-sequence-packing-algo",
        "fifo",
        "How rollouts are packed.",
        choices=["fifo", "round-robin"],
    )
    g.both("--rl-skip-bos-token", False, "Drop the BOS token from the rollouts.", type=bool)
    g.true("--rl-profile", "Profile the RL loop.")
    g.str("--rl-profile-dir", None, "Where the RL profiles are written.")
    g._add("--rl-inference-parsers", nargs="*", default=[], help="Parsers of the model outputs.")


def _grpo(g):
    g.int("--grpo-iterations", 2, "Optimizer passes over each batch of rollouts.")
    g.float("--grpo-clamp-eps-lower", 0.01, "Lower clamp of the policy ratio.")
    g.float("--grpo-clamp-eps-upper", 0.01, "Upper clamp of the policy ratio.")
    g.float("--grpo-kl-beta", 0.001, "Weight of the KL penalty.")
    g.float("--grpo-entropy-term-weight", 0.0, "Weight of the entropy bonus.")
    g.true(
        "--grpo-filter-groups-with-same-reward",
        "Drop groups whose rollouts all got the same reward.",
    )
    g.both(
        "--rl-inference-logprobs-is-correction",
        False,
        "Correct for the inference engine's log-probabilities.",
        type=bool,
    )
    g.float(
        "--rl-importance-sampling-truncation-coef",
        None,
        "Truncation of the importance-sampling weights.",
    )


def _inference_model(g):
    g.true(
        "--rl-offload-optimizer-during-inference",
        "Move the optimizer state to the CPU while rollouts are generated.",
    )
    g.str(
        "--rl-kv-cache-management-mode",
        "persist",
        "What happens to the KV cache between generation phases.",
        choices=["persist", "offload", "recompute"],
    )
    g.both(
        "--rl-persist-cuda-graphs",
        False,
        "Keep the inference CUDA graphs between phases.",
        type=bool,
    )
    g.both("--rl-training-cuda-graphs", False, "CUDA graphs for the training steps.", type=bool)
    for kind in ("tensor", "pipeline", "expert", "expert-tensor"):
        flag = f"--rl-inference-{kind}-model-parallel-size"
        g.int(
            flag, None, f"{kind.replace('-', ' ').capitalize()} parallelism of the inference model."
        )
    g.int(
        "--rl-inference-model-unified-memory-level",
        0,
        "Keep the inference model in CUDA unified memory (1) or not (0).",
        choices=[0, 1],
    )
    g.both(
        "--rl-offload-inference-model-weights-when-idle",
        False,
        "Move the inference model's weights to the CPU while it is idle.",
    )
    g.str(
        "--refit-method",
        "gloo",
        "How the trained weights reach the inference model.",
        choices=["nccl", "gloo", "nvshmem"],
    )
    g.both(
        "--rl-verify-model-weights-swap",
        False,
        "Check the inference model's weights after each refit.",
    )


def _add_logits_distillation_args(parser):
    g = ArgGroup(parser, "Logits Distillation")
    g.int("--logits-save-top-k", None, "Save the top-k logits of each token.")
    g.float("--logits-save-top-p", None, "Save the logits within this top-p mass.")
    g.int(
        "--logits-save-top-p-min-k", 1, "Logits saved at least per token with --logits-save-top-p."
    )
    g.str("--logits-save-dir", None, "Directory the teacher logits are written to.")
    g.str(
        "--logits-save-dtype",
        "fp16",
        "Dtype of the saved logits.",
        choices=["fp16", "bf16", "fp32"],
    )
    g.str("--logits-load-dir", None, "Directory of teacher logits to distil from.")
    g.int("--logits-load-decode-threads", 4, "Threads decoding the loaded logits.")
    g.int("--logits-load-prefetch-factor", 3, "Batches of logits prefetched.")
    g.int("--logits-load-msc-prefetch-depth", 2, "Prefetch depth of the multi-storage client.")
    g.float("--logits-load-kd-loss-alpha", 1.0, "Weight of the distillation loss.")
    g.true("--logits-load-ignore-errors", "Skip batches whose logits cannot be read.")
    return parser
