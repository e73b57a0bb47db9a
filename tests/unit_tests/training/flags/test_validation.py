"""Every rule of validate_args in megatron/training/flags/rules/ (the steps of the pass but moe,
numerics and rerun): for each rule a command line that breaks it, and the words its
message must contain (the flags at fault and their values, in order).
test_every_rule_has_a_case reads the rule modules and fails when a rule has no case below, so a
new rule arrives with its test."""

import functools
import re

import pytest

from megatron.training.arguments import ArgumentValidationError
from megatron.training.flags.rules import (
    batch,
    checkpoint,
    data,
    deprecated,
    dp_strategy,
    layer,
    monitoring,
    parallel,
    pipeline,
    precision,
    recompute,
    schedule,
    shape,
)
from tests.unit_tests.tiny_configs import tiny_args
from tests.unit_tests.training.flags.rule_coverage import fired_rule_sites, rule_sites

FSDP2 = ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]
FSDP2 += ["--untie-embeddings-and-output-weights"]
MEGATRON_FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
SAMPLES = dict(drop=("--train-iters",))  # sample-based training: --train-samples instead
GDN = ["--experimental-attention-variant", "gated_delta_net"]
GQA_12_HEADS = ["--num-attention-heads", 12, "--hidden-size", 96, "--group-query-attention"]


def case(case_id, extra, words, world_size=1, drop=(), env=None):
    return pytest.param(extra, words, world_size, drop, env or {}, id=case_id)


# (id, extra flags, words of the message in order, world size, flags dropped, environment)
CASES = [
    # ------------------------------------------------------------ deprecated spellings
    case(
        "enable_cuda_graph_with_impl",
        ["--enable-cuda-graph", "--cuda-graph-impl", "local"],
        ["--enable-cuda-graph is deprecated", "--cuda-graph-impl local"],
    ),
    case(
        "external_cuda_graph_with_impl",
        ["--external-cuda-graph", "--cuda-graph-impl", "local"],
        ["--external-cuda-graph is deprecated", "--cuda-graph-impl local"],
    ),
    case(
        "removed_but_parsed",
        ["--batch-size", 4],
        ["--batch-size is no longer supported", "--micro-batch-size"],
    ),
    case("spec_two_words", ["--spec", "a", "b", "c"], ["--spec takes <module> <name>", "a b c"]),
    case(
        "spec_importable",
        ["--spec", "no_such_module_here", "layer_spec"],
        ["--spec no_such_module_here layer_spec", "no_such_module_here"],
    ),
    case(
        "weight_hash_interval_positive",
        ["--check-weight-hash-across-dp-replicas-interval", 0],
        ["--check-weight-hash-across-dp-replicas-interval must be > 0", "0"],
    ),
    case(
        "weight_hash_not_with_fsdp2",
        ["--check-weight-hash-across-dp-replicas-interval", 5] + FSDP2,
        ["--check-weight-hash-across-dp-replicas-interval cannot be used with FSDP2"],
    ),
    case(
        "cuda_graphs_warmup",
        ["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", 0],
        ["--cuda-graph-warmup-steps must be at least 1 with --cuda-graph-impl local"],
    ),
    case(
        "cuda_graphs_without_dropout",
        ["--cuda-graph-impl", "local", "--hidden-dropout", 0.1],
        ["--cuda-graph-impl local does not support dropout"],
    ),
    case(
        "cuda_graphs_not_of_compiled_layers",
        ["--cuda-graph-impl", "local", "--hidden-dropout", 0, "--attention-dropout", 0]
        + ["--compile-transformer-layers"],
        ["--cuda-graph-impl local does not support --compile-transformer-layers"],
    ),
    case(
        "cp_comm_type_known",
        ["--cp-comm-type", "ring"],
        ["--cp-comm-type: unknown value 'ring'", "p2p, a2a, allgather, a2a+p2p"],
    ),
    # ------------------------------------------------------------ parallel sizes
    case("tp_positive", ["--tensor-model-parallel-size", 0], ["--tensor-model-parallel-size", "0"]),
    case(
        "pp_positive",
        ["--pipeline-model-parallel-size", 0],
        ["--pipeline-model-parallel-size must be >= 1", "0"],
    ),
    case("cp_positive", ["--context-parallel-size", 0], ["--context-parallel-size must be >= 1"]),
    case(
        "ep_positive",
        ["--expert-model-parallel-size", 0],
        ["--expert-model-parallel-size must be >= 1"],
    ),
    case("world_size_positive", [], ["world size (WORLD_SIZE=0) must be >= 1"], world_size=0),
    case(
        "world_size_factors",
        ["--tensor-model-parallel-size", 4],
        ["world size (6)", "tensor-model-parallel size (4)", "= 4"],
        world_size=6,
    ),
    case(
        "hierarchical_cp_product",
        ["--context-parallel-size", 2, "--hierarchical-context-parallel-sizes", 2, 2],
        ["--hierarchical-context-parallel-sizes [2, 2]", "4", "--context-parallel-size (2)"],
        world_size=2,
    ),
    case(
        "a2a_p2p_needs_hierarchy",
        ["--context-parallel-size", 2, "--cp-comm-type", "a2a+p2p"],
        ["--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"],
        world_size=2,
    ),
    case(
        "hierarchical_cp_positive",
        ["--context-parallel-size", 2, "--hierarchical-context-parallel-sizes", -1, -2],
        ["--hierarchical-context-parallel-sizes must be >= 1", "[-1, -2]"],
        world_size=2,
    ),
    case(
        "delay_wgrad_needs_ep_overlap",
        ["--delay-wgrad-compute"],
        ["--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"],
    ),
    case(
        "ep_overlap_pp_needs_vpp",
        [
            "--overlap-moe-expert-parallel-comm",
            "--num-experts",
            4,
            "--expert-model-parallel-size",
            2,
            "--moe-token-dispatcher-type",
            "alltoall",
            "--bf16",
            "--pipeline-model-parallel-size",
            2,
        ],
        ["--overlap-moe-expert-parallel-comm", "needs virtual pipeline stages"],
        world_size=4,
    ),
    case(
        "ep_overlap_needs_ep",
        ["--overlap-moe-expert-parallel-comm", "--num-experts", 4, "--bf16"],
        ["--overlap-moe-expert-parallel-comm needs expert parallelism"],
    ),
    case(
        "ep_overlap_needs_alltoall",
        [
            "--overlap-moe-expert-parallel-comm",
            "--num-experts",
            4,
            "--expert-model-parallel-size",
            2,
            "--moe-token-dispatcher-type",
            "allgather",
            "--bf16",
        ],
        ["--overlap-moe-expert-parallel-comm needs --moe-token-dispatcher-type", "allgather"],
        world_size=2,
    ),
    case(
        "ep_overlap_one_mtp_layer",
        [
            "--overlap-moe-expert-parallel-comm",
            "--num-experts",
            4,
            "--expert-model-parallel-size",
            2,
            "--moe-token-dispatcher-type",
            "alltoall",
            "--bf16",
            "--mtp-num-layers",
            2,
            "--position-embedding-type",
            "rope",
        ],
        ["--overlap-moe-expert-parallel-comm takes at most one MTP layer", "--mtp-num-layers 2"],
        world_size=2,
    ),
    case(
        "ep_overlap_no_full_recompute",
        [
            "--overlap-moe-expert-parallel-comm",
            "--num-experts",
            4,
            "--expert-model-parallel-size",
            2,
            "--moe-token-dispatcher-type",
            "alltoall",
            "--bf16",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
        ],
        ["--overlap-moe-expert-parallel-comm cannot be combined with full recompute"],
        world_size=2,
    ),
    case(
        "ep_overlap_no_recompute_method",
        [
            "--overlap-moe-expert-parallel-comm",
            "--num-experts",
            4,
            "--expert-model-parallel-size",
            2,
            "--moe-token-dispatcher-type",
            "alltoall",
            "--bf16",
            "--recompute-method",
            "uniform",
        ],
        ["--overlap-moe-expert-parallel-comm cannot be combined with --recompute-method"],
        world_size=2,
    ),
    case(
        "ep_overlap_no_recompute_num_layers",
        [
            "--overlap-moe-expert-parallel-comm",
            "--num-experts",
            4,
            "--expert-model-parallel-size",
            2,
            "--moe-token-dispatcher-type",
            "alltoall",
            "--bf16",
            "--recompute-num-layers",
            1,
        ],
        ["--overlap-moe-expert-parallel-comm cannot be combined with --recompute-num-layers"],
        world_size=2,
    ),
    case(
        "ep_overlap_needs_half_precision",
        [
            "--overlap-moe-expert-parallel-comm",
            "--num-experts",
            4,
            "--expert-model-parallel-size",
            2,
            "--moe-token-dispatcher-type",
            "alltoall",
        ],
        ["--overlap-moe-expert-parallel-comm needs --bf16 or --fp16"],
        world_size=2,
    ),
    case(
        "ep_overlap_no_shared_expert_overlap",
        [
            "--overlap-moe-expert-parallel-comm",
            "--num-experts",
            4,
            "--expert-model-parallel-size",
            2,
            "--moe-token-dispatcher-type",
            "alltoall",
            "--bf16",
            "--moe-shared-expert-overlap",
        ],
        ["--overlap-moe-expert-parallel-comm cannot be combined with --moe-shared-expert-overlap"],
        world_size=2,
    ),
    case(
        "etp_positive",
        ["--expert-tensor-parallel-size", 0],
        ["--expert-tensor-parallel-size must be >= 1 (got 0)"],
    ),
    case(
        "ep_needs_experts",
        ["--expert-model-parallel-size", 2],
        ["--expert-model-parallel-size 2 needs --num-experts"],
        world_size=2,
    ),
    case(
        "ep_without_fp16",
        ["--expert-model-parallel-size", 2, "--num-experts", 2, "--fp16"],
        ["--expert-model-parallel-size 2 does not support --fp16"],
        world_size=2,
    ),
    case(
        "experts_divisible_by_ep",
        ["--num-experts", 3, "--expert-model-parallel-size", 2],
        ["--num-experts (3)", "--expert-model-parallel-size (2)"],
        world_size=2,
    ),
    case(
        "world_size_factors_for_experts",
        ["--expert-tensor-parallel-size", 4],
        ["world size (2)", "expert-tensor-parallel size (4)", "= 4"],
        world_size=2,
    ),
    # ------------------------------------------------------------ model shape
    case(
        "num_layers_and_encoder_num_layers",
        ["--encoder-num-layers", 2],
        ["--num-layers and --encoder-num-layers are mutually exclusive"],
    ),
    case("num_layers_required", [], ["--num-layers is required"], drop=("--num-layers",)),
    case(
        "hybrid_pattern_symbol",
        ["--hybrid-layer-pattern", "M*X"],
        ["--hybrid-override-pattern 'M*X': unknown layer symbol 'X'"],
        drop=("--num-layers",),
    ),
    case("hidden_size_required", [], ["--hidden-size is required"], drop=("--hidden-size",)),
    case(
        "heads_required",
        [],
        ["--num-attention-heads is required"],
        drop=("--num-attention-heads",),
    ),
    case(
        "max_positions_required",
        [],
        ["--max-position-embeddings is required"],
        drop=("--max-position-embeddings",),
    ),
    case("num_layers_positive", ["--num-layers", 0], ["--num-layers must be > 0 (got 0)"]),
    case("hidden_size_positive", ["--hidden-size", -64], ["--hidden-size must be > 0 (got -64)"]),
    case("heads_positive", ["--num-attention-heads", 0], ["--num-attention-heads must be > 0"]),
    case(
        "max_positions_positive",
        ["--max-position-embeddings", 0],
        ["--max-position-embeddings must be > 0 (got 0)"],
    ),
    case(
        "hidden_divisible_by_heads",
        ["--hidden-size", 66],
        ["--hidden-size (66)", "--num-attention-heads (4)", "--kv-channels"],
    ),
    case(
        "heads_divisible_by_tp",
        ["--tensor-model-parallel-size", 3],
        ["--num-attention-heads (4)", "--tensor-model-parallel-size (3)"],
        world_size=3,
    ),
    case(
        "query_groups_positive",
        ["--group-query-attention", "--num-query-groups", 0],
        ["--num-query-groups must be > 0 (got 0)"],
    ),
    case(
        "heads_divisible_by_query_groups",
        ["--group-query-attention", "--num-query-groups", 3],
        ["--num-attention-heads (4)", "--num-query-groups (3)"],
    ),
    # The case: TransformerConfig (and Megatron) need whole groups on every TP rank.
    case(
        "one_query_group_on_two_tp_ranks",
        ["--group-query-attention", "--num-query-groups", 1, "--tensor-model-parallel-size", 2],
        ["--num-query-groups (1) must be a multiple of --tensor-model-parallel-size (2)"],
        world_size=2,
    ),
    case(
        "query_groups_not_a_multiple_of_tp",
        GQA_12_HEADS + ["--num-query-groups", 3, "--tensor-model-parallel-size", 2],
        ["--num-query-groups (3)", "--tensor-model-parallel-size (2)"],
        world_size=2,
    ),
    case(
        "seq_length_and_encoder_seq_length",
        ["--encoder-seq-length", 64],
        ["--seq-length and --encoder-seq-length are mutually exclusive"],
    ),
    case("seq_length_required", [], ["--seq-length is required"], drop=("--seq-length",)),
    case("seq_length_positive", ["--seq-length", 0], ["--seq-length must be > 0 (got 0)"]),
    case(
        "cp_splits_sequence_in_2cp_chunks",
        ["--context-parallel-size", 2, "--seq-length", 126],
        ["--seq-length (126)", "--context-parallel-size (2) = 4"],
        world_size=2,
    ),
    case(
        "max_positions_cover_seq_length",
        ["--seq-length", 512],
        ["--max-position-embeddings (256) must be >= --seq-length (512)"],
    ),
    case(
        "max_positions_cover_decoder_seq_length",
        ["--decoder-seq-length", 512],
        ["--max-position-embeddings (256) must be >= --decoder-seq-length (512)"],
    ),
    case(
        "swiglu_and_squared_relu",
        ["--swiglu", "--squared-relu"],
        ["--swiglu and --squared-relu are mutually exclusive"],
    ),
    case(
        "hidden_dropout_range",
        ["--hidden-dropout", 1.5],
        ["--hidden-dropout must be in [0, 1] (got 1.5)"],
    ),
    case(
        "attention_dropout_range",
        ["--attention-dropout", -0.1],
        ["--attention-dropout must be in [0, 1] (got -0.1)"],
    ),
    case("rotary_percent_zero", ["--rotary-percent", 0], ["--rotary-percent", "(got 0.0)"]),
    case("rotary_percent_above_one", ["--rotary-percent", 1.5], ["--rotary-percent", "1.5"]),
    case(
        "vocab_divisor_positive",
        ["--make-vocab-size-divisible-by", 0],
        ["--make-vocab-size-divisible-by must be > 0 (got 0)"],
    ),
    case(
        "mrope_needs_sections",
        ["--position-embedding-type", "mrope"],
        ["--position-embedding-type mrope needs --mrope-section"],
    ),
    case(
        "mtp_layers_not_negative",
        ["--mtp-num-layers", -1, "--position-embedding-type", "rope"],
        ["--mtp-num-layers must be >= 0 (got -1)"],
    ),
    case(
        "mtp_needs_rope_or_none",
        ["--mtp-num-layers", 1],
        ["--mtp-num-layers", "--position-embedding-type rope or none", "learned_absolute"],
    ),
    case(
        "experts_without_spec",
        [
            "--num-experts",
            2,
            "--spec",
            "megatron.core.models.gpt.gpt_layer_specs",
            "get_gpt_layer_local_spec",
        ],
        ["--num-experts cannot be combined with --spec"],
    ),
    case(
        "router_topk_within_experts",
        ["--num-experts", 2, "--moe-router-topk", 3],
        ["--moe-router-topk (3)", "--num-experts (2)"],
    ),
    # ------------------------------------------------------------ batch sizes
    case(
        "micro_batch_required",
        [],
        ["--micro-batch-size is required"],
        drop=("--micro-batch-size",),
    ),
    case("micro_batch_positive", ["--micro-batch-size", 0], ["--micro-batch-size must be > 0"]),
    case(
        "step_schedule_and_global_batch",
        ["--step-batch-size-schedule", "0:16", "--global-batch-size", 16],
        ["--step-batch-size-schedule and --global-batch-size are mutually exclusive"],
    ),
    case(
        "global_batch_positive",
        ["--global-batch-size", 0],
        ["--global-batch-size must be > 0 (got 0)"],
    ),
    case(
        "rampup_positive_start",
        ["--train-samples", 1000, "--global-batch-size", 16, "--rampup-batch-size", 0, 2, 100],
        ["--rampup-batch-size needs start > 0", "[0, 2, 100]"],
        **SAMPLES,
    ),
    case(
        "rampup_start_within_global_batch",
        ["--train-samples", 1000, "--global-batch-size", 16, "--rampup-batch-size", 32, 2, 100],
        ["--rampup-batch-size start (32)", "--global-batch-size (16)"],
        **SAMPLES,
    ),
    case(
        "rampup_reaches_global_batch",
        ["--train-samples", 1000, "--global-batch-size", 16, "--rampup-batch-size", 2, 4, 100],
        ["--global-batch-size (16)", "--rampup-batch-size start (2)", "increment (4)"],
        **SAMPLES,
    ),
    case(
        "rampup_needs_samples",
        ["--rampup-batch-size", 2, 2, 100],
        ["--rampup-batch-size needs sample-based training", "--train-samples"],
    ),
    case(
        "eval_micro_batch_positive",
        ["--eval-micro-batch-size", -1],
        ["--eval-micro-batch-size must be > 0 (got -1)"],
    ),
    case(
        "eval_batches_divide",
        ["--eval-global-batch-size", 6, "--eval-micro-batch-size", 4],
        ["evaluation global batch size (6)", "micro batch size (4)", "--eval-global-batch-size"],
    ),
    case(
        "global_batch_in_micro_batches",
        ["--global-batch-size", 6],
        ["--global-batch-size (6)", "--micro-batch-size (2)", "data-parallel size (2) = 4"],
        world_size=2,
    ),
    case(
        "rampup_start_in_micro_batches",
        ["--train-samples", 1000, "--global-batch-size", 16, "--rampup-batch-size", 3, 13, 100],
        ["the --rampup-batch-size start (3)", "--micro-batch-size (2)"],
        **SAMPLES,
    ),
    case(
        "rampup_increment_in_micro_batches",
        ["--train-samples", 1000, "--global-batch-size", 16, "--rampup-batch-size", 4, 3, 100],
        ["the --rampup-batch-size increment (3)", "--micro-batch-size (2)"],
        **SAMPLES,
    ),
    # ------------------------------------------------------------ pipeline
    case(
        "virtual_pipeline_flags_exclusive",
        ["--num-layers-per-virtual-pipeline-stage", 1, "--num-virtual-stages-per-pipeline-rank", 2],
        ["--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank"],
    ),
    case(
        "layers_per_virtual_stage_not_uneven",
        ["--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 1]
        + ["--decoder-first-pipeline-num-layers", 1],
        ["--num-layers-per-virtual-pipeline-stage cannot be combined with", "first/last"],
        world_size=2,
    ),
    case(
        "layers_per_virtual_stage_positive",
        ["--num-layers-per-virtual-pipeline-stage", 0],
        ["--num-layers-per-virtual-pipeline-stage must be > 0 (got 0)"],
    ),
    case(
        "virtual_stages_need_layers_divisible_by_pp",
        ["--pipeline-model-parallel-size", 3, "--num-layers-per-virtual-pipeline-stage", 1],
        ["--num-layers 4 = 4", "--pipeline-model-parallel-size (3)"],
        world_size=3,
    ),
    case(
        "stage_layers_divisible_by_virtual_stage",
        ["--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 3],
        ["layers per pipeline stage (2)", "--num-layers-per-virtual-pipeline-stage (3)"],
        world_size=2,
    ),
    case(
        "virtual_stages_positive",
        ["--num-virtual-stages-per-pipeline-rank", 0],
        ["--num-virtual-stages-per-pipeline-rank must be > 0 (got 0)"],
    ),
    case(
        "layers_divisible_by_pp",
        ["--pipeline-model-parallel-size", 3],
        ["number of layers (--num-layers 4 = 4)", "--pipeline-model-parallel-size (3)"],
        world_size=3,
    ),
    case(
        "embedding_counted_in_split",
        ["--pipeline-model-parallel-size", 2, "--account-for-embedding-in-pipeline-split"],
        ["--account-for-embedding-in-pipeline-split) = 5", "--pipeline-model-parallel-size (2)"],
        world_size=2,
    ),
    case(
        "interleaving_needs_pp",
        ["--num-virtual-stages-per-pipeline-rank", 2],
        ["interleaved", "--pipeline-model-parallel-size > 1 (got 1)"],
    ),
    case(
        "interleaving_without_overlap_needs_pp3",
        ["--pipeline-model-parallel-size", 2, "--num-virtual-stages-per-pipeline-rank", 2]
        + ["--no-overlap-p2p-communication"],
        ["--no-overlap-p2p-communication", "--pipeline-model-parallel-size > 2 (got 2)"],
        world_size=2,
    ),
    case(
        "uneven_split_not_with_accounting",
        ["--pipeline-model-parallel-size", 2, "--decoder-first-pipeline-num-layers", 2]
        + ["--account-for-embedding-in-pipeline-split"],
        ["--decoder-first/last-pipeline-num-layers cannot be combined with", "--account-for"],
        world_size=2,
    ),
    case(
        "interleaving_micro_batches",
        ["--pipeline-model-parallel-size", 2, "--num-virtual-stages-per-pipeline-rank", 2]
        + ["--global-batch-size", 2],
        ["--microbatch-group-size-per-virtual-pipeline-stage", "number of micro-batches=1"],
        world_size=2,
    ),
    case(
        "uneven_split_needs_pp",
        ["--decoder-first-pipeline-num-layers", 1],
        ["--decoder-first/last-pipeline-num-layers need", "--pipeline-model-parallel-size > 1"],
    ),
    case(
        "first_stage_layers_not_negative",
        ["--pipeline-model-parallel-size", 2, "--decoder-first-pipeline-num-layers", -1],
        ["--decoder-first-pipeline-num-layers must be >= 0 (got -1)"],
        world_size=2,
    ),
    case(
        "last_stage_layers_not_negative",
        ["--pipeline-model-parallel-size", 2, "--decoder-last-pipeline-num-layers", -1],
        ["--decoder-last-pipeline-num-layers must be >= 0 (got -1)"],
        world_size=2,
    ),
    case(
        "uneven_rest_splits_evenly",
        ["--pipeline-model-parallel-size", 3, "--decoder-first-pipeline-num-layers", 1],
        ["--num-layers (4)", "(1/None) = 3", "other 2 pipeline stages"],
        world_size=3,
    ),
    # ------------------------------------------------------------ data-parallel strategy
    case(
        "bucket_count_and_size",
        ["--ddp-num-buckets", 2, "--ddp-bucket-size", 1000],
        ["--ddp-num-buckets 2 and --ddp-bucket-size 1000 are mutually exclusive"],
    ),
    case("bucket_count_positive", ["--ddp-num-buckets", 0], ["--ddp-num-buckets", "got 0"]),
    case(
        "optimizer_instances_positive",
        ["--num-distributed-optimizer-instances", 0],
        ["--num-distributed-optimizer-instances must be >= 1 (got 0)"],
    ),
    case(
        "optimizer_instances_need_distributed_optimizer",
        ["--num-distributed-optimizer-instances", 2],
        ["--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer"],
        world_size=2,
    ),
    case(
        "optimizer_instances_divide_dp",
        ["--num-distributed-optimizer-instances", 3, "--use-distributed-optimizer"],
        ["--num-distributed-optimizer-instances 3 does not divide", "size 4"],
        world_size=4,
    ),
    case(
        "optimizer_instances_divide_expert_dp",
        ["--num-distributed-optimizer-instances", 2, "--use-distributed-optimizer"]
        + ["--num-experts", 4, "--expert-model-parallel-size", 4],
        ["--num-distributed-optimizer-instances 2 does not divide the expert-data-parallel size 1"],
        world_size=4,
    ),
    case(
        "param_gather_needs_distributed_optimizer",
        ["--overlap-param-gather", "--overlap-grad-reduce"],
        ["--overlap-param-gather needs --use-distributed-optimizer"],
    ),
    case(
        "param_gather_needs_grad_reduce_overlap",
        ["--overlap-param-gather", "--use-distributed-optimizer"],
        ["--overlap-param-gather needs --overlap-grad-reduce"],
    ),
    case(
        "gather_in_step_needs_distributed_optimizer",
        ["--overlap-param-gather-with-optimizer-step"],
        ["--overlap-param-gather-with-optimizer-step needs --use-distributed-optimizer"],
    ),
    case(
        "gather_in_step_needs_param_gather",
        ["--overlap-param-gather-with-optimizer-step", "--use-distributed-optimizer"],
        ["--overlap-param-gather-with-optimizer-step needs --overlap-param-gather"],
    ),
    case(
        "gather_in_step_needs_virtual_stages",
        ["--overlap-param-gather-with-optimizer-step", "--use-distributed-optimizer"]
        + ["--overlap-param-gather", "--overlap-grad-reduce"],
        ["--overlap-param-gather-with-optimizer-step needs virtual pipeline stages"],
    ),
    case(
        "two_fsdp_kinds",
        ["--use-torch-fsdp2", "--use-megatron-fsdp"],
        ["--use-torch-fsdp2 and --use-megatron-fsdp are mutually exclusive"],
    ),
    case(
        "fsdp2_without_pipeline",
        FSDP2 + ["--pipeline-model-parallel-size", 2],
        ["--use-torch-fsdp2 does not support pipeline parallelism"],
        world_size=2,
    ),
    case(
        "fsdp2_without_experts",
        FSDP2 + ["--expert-model-parallel-size", 2, "--num-experts", 2],
        ["--use-torch-fsdp2 does not support expert parallelism"],
        world_size=2,
    ),
    case(
        "fsdp2_without_grad_accumulation_fusion",
        ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],
        ["--use-torch-fsdp2 does not support gradient accumulation fusion"],
    ),
    case("fsdp2_without_fp16", FSDP2 + ["--fp16"], ["--use-torch-fsdp2 does not support --fp16"]),
    case(
        "fsdp2_without_one_connection",
        FSDP2,
        ["--use-torch-fsdp2 does not support CUDA_DEVICE_MAX_CONNECTIONS=1"],
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    ),
    case(
        "fsdp2_without_distributed_optimizer",
        FSDP2 + ["--use-distributed-optimizer"],
        ["--use-torch-fsdp2 does not support --use-distributed-optimizer"],
    ),
    case(
        "fsdp2_checkpoint_format",
        FSDP2 + ["--ckpt-format", "torch"],
        ["--use-torch-fsdp2 does not support --ckpt-format torch"],
    ),
    case(
        "fsdp2_shards_everything",
        FSDP2 + ["--data-parallel-sharding-strategy", "optim"],
        ["--data-parallel-sharding-strategy optim cannot be used with --use-torch-fsdp2"],
    ),
    case(
        "megatron_fsdp_checkpoint_format",
        ["--use-megatron-fsdp"],
        ["--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (got torch_dist)"],
    ),
    case(
        "megatron_fsdp_without_one_connection",
        MEGATRON_FSDP + ["--data-parallel-sharding-strategy", "optim"],
        ["--use-megatron-fsdp does not support CUDA_DEVICE_MAX_CONNECTIONS=1"],
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    ),
    case(
        "megatron_fsdp_torch_dcp_checkpoints",
        ["--use-megatron-fsdp", "--ckpt-format", "torch_dcp", "--load", "/x"],
        ["--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (got torch_dcp)"],
    ),
    case(
        "megatron_fsdp_no_shard_has_nothing_to_gather",
        MEGATRON_FSDP
        + ["--data-parallel-sharding-strategy", "no_shard"]
        + ["--overlap-param-gather", "--overlap-grad-reduce"],
        ["--overlap-param-gather has nothing to gather", "no_shard"],
    ),
    case(
        "sharding_strategy_needs_megatron_fsdp",
        ["--data-parallel-sharding-strategy", "optim"],
        ["--data-parallel-sharding-strategy optim needs --use-megatron-fsdp"],
    ),
    case(
        "muon_without_fsdp2",
        ["--optimizer", "muon"] + FSDP2,
        ["--optimizer muon does not support --use-torch-fsdp2"],
    ),
    case(
        "muon_without_megatron_fsdp",
        ["--optimizer", "muon"] + MEGATRON_FSDP + ["--data-parallel-sharding-strategy", "no_shard"],
        ["--optimizer muon does not support --use-megatron-fsdp"],
    ),
    case(
        "optimizer_offload_needs_precision_aware",
        ["--optimizer-cpu-offload"],
        ["--optimizer-cpu-offload needs --use-precision-aware-optimizer"],
    ),
    case(
        "fp8_param_gather_needs_sharding",
        ["--fp8-param-gather"],
        ["--fp8-param-gather needs --use-distributed-optimizer or FSDP"],
    ),
    case(
        "tp_comm_overlap_needs_sequence_parallel",
        ["--tp-comm-overlap"],
        ["--tp-comm-overlap needs --sequence-parallel"],
    ),
    # ------------------------------------------------------------ precision
    case("fp16_and_bf16", ["--fp16", "--bf16"], ["--fp16 and --bf16 are mutually exclusive"]),
    case(
        "fp32_accumulation_needs_fp32_grads",
        ["--bf16", "--accumulate-allreduce-grads-in-fp32", "--main-grads-dtype", "bf16"],
        ["--accumulate-allreduce-grads-in-fp32 needs --main-grads-dtype fp32"],
    ),
    case(
        "fp16_cross_entropy_needs_fp16",
        ["--fp16-lm-cross-entropy"],
        ["--fp16-lm-cross-entropy needs --fp16"],
    ),
    case(
        "fp32_residual_needs_half_precision",
        ["--fp32-residual-connection"],
        ["--fp32-residual-connection needs --fp16 or --bf16"],
    ),
    case("loss_scale_positive", ["--loss-scale", 0], ["--loss-scale must be > 0 (got 0.0)"]),
    case(
        "initial_loss_scale_positive",
        ["--initial-loss-scale", 0],
        ["--initial-loss-scale must be > 0 (got 0.0)"],
    ),
    case(
        "min_loss_scale_positive",
        ["--min-loss-scale", 0],
        ["--min-loss-scale must be > 0 (got 0.0)"],
    ),
    case(
        "loss_scale_window_positive",
        ["--loss-scale-window", 0],
        ["--loss-scale-window must be > 0 (got 0"],
    ),
    case(
        "min_loss_scale_below_initial",
        ["--min-loss-scale", 4, "--initial-loss-scale", 2],
        ["--min-loss-scale (4.0) must be <= --initial-loss-scale (2.0)"],
    ),
    case("hysteresis_positive", ["--hysteresis", 0], ["--hysteresis must be >= 1 (got 0)"]),
    # ------------------------------------------------------------ checkpointing
    case(
        "save_needs_interval",
        ["--save", "/tmp/ckpt"],
        ["--save needs --save-interval > 0 (got None)"],
    ),
    case(
        "save_interval_positive",
        ["--save", "/tmp/ckpt", "--save-interval", 0],
        ["--save needs --save-interval > 0 (got 0)"],
    ),
    case(
        "retain_interval_positive",
        ["--save-retain-interval", 0],
        ["--save-retain-interval must be > 0 (got 0)"],
    ),
    case(
        "retain_interval_multiple_of_save_interval",
        ["--save-interval", 10, "--save-retain-interval", 15],
        ["--save-retain-interval (15)", "--save-interval (10)"],
    ),
    case(
        "main_params_only_without_optimizer",
        ["--load-main-params-from-ckpt"],
        ["--load-main-params-from-ckpt needs --no-load-optim"],
    ),
    case(
        "local_non_persistent_needs_dir",
        ["--non-persistent-ckpt-type", "local"],
        ["--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir"],
    ),
    case(
        "torch_dcp_needs_fsdp2",
        ["--ckpt-format", "torch_dcp"],
        ["--ckpt-format torch_dcp needs --use-torch-fsdp2"],
    ),
    case(
        "fsdp_dtensor_needs_megatron_fsdp",
        ["--ckpt-format", "fsdp_dtensor"],
        ["--ckpt-format fsdp_dtensor needs --use-megatron-fsdp"],
    ),
    case(
        "convert_format_needs_destination",
        ["--ckpt-convert-format", "torch"],
        ["--ckpt-convert-format needs --ckpt-convert-save"],
    ),
    # ------------------------------------------------------------ schedule
    case(
        "iters_and_samples",
        ["--train-samples", 100],
        ["--train-iters and --train-samples are mutually exclusive"],
    ),
    case(
        "iters_or_samples_required",
        [],
        ["one of --train-iters or --train-samples is required", "--skip-train"],
        drop=("--train-iters",),
    ),
    case("train_iters_not_negative", ["--train-iters", -1], ["--train-iters must be >= 0"]),
    case(
        "train_samples_not_negative",
        ["--train-samples", -1],
        ["--train-samples must be >= 0 (got -1)"],
        **SAMPLES,
    ),
    case(
        "decay_samples_in_iteration_mode",
        ["--lr-decay-samples", 100],
        ["--lr-decay-samples (100)", "--train-iters", "use --lr-decay-iters"],
    ),
    case(
        "warmup_samples_in_iteration_mode",
        ["--lr-warmup-samples", 5],
        ["--lr-warmup-samples (5)", "--train-iters", "use --lr-warmup-iters"],
    ),
    case(
        "wsd_decay_samples_in_iteration_mode",
        ["--lr-wsd-decay-samples", 5],
        ["--lr-wsd-decay-samples (5)", "--train-iters", "use --lr-wsd-decay-iters"],
    ),
    case(
        "decay_iters_in_sample_mode",
        ["--train-samples", 100, "--lr-decay-iters", 5],
        ["--lr-decay-iters (5)", "--train-samples", "use --lr-decay-samples"],
        **SAMPLES,
    ),
    case(
        "warmup_iters_in_sample_mode",
        ["--train-samples", 100, "--lr-warmup-iters", 5],
        ["--lr-warmup-iters (5)", "--train-samples", "use --lr-warmup-samples"],
        **SAMPLES,
    ),
    case(
        "wsd_decay_iters_in_sample_mode",
        ["--train-samples", 100, "--lr-wsd-decay-iters", 5],
        ["--lr-wsd-decay-iters (5)", "--train-samples", "use --lr-wsd-decay-samples"],
        **SAMPLES,
    ),
    case(
        "warmup_fraction_and_iters",
        ["--lr-warmup-fraction", 0.1, "--lr-warmup-iters", 2],
        ["--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive"],
    ),
    case(
        "warmup_fraction_and_samples",
        ["--train-samples", 100, "--lr-warmup-fraction", 0.1, "--lr-warmup-samples", 2],
        ["--lr-warmup-fraction and --lr-warmup-samples are mutually exclusive"],
        **SAMPLES,
    ),
    case(
        "warmup_fraction_range",
        ["--lr-warmup-fraction", 1.0],
        ["--lr-warmup-fraction must be in [0, 1) (got 1.0)"],
    ),
    case(
        "warmup_iters_shorter_than_decay",
        ["--lr-warmup-iters", 10],
        ["--lr-warmup-iters (10)", "--train-iters (10)"],
    ),
    case(
        "warmup_samples_shorter_than_decay",
        ["--train-samples", 100, "--lr-warmup-samples", 100, "--lr-decay-samples", 50],
        ["--lr-warmup-samples (100)", "--lr-decay-samples (50)"],
        **SAMPLES,
    ),
    case(
        "warmup_iters_not_negative",
        ["--lr-warmup-iters", -1],
        ["--lr-warmup-iters must be >= 0 (got -1)"],
    ),
    case(
        "wsd_needs_anneal_iters",
        ["--lr-decay-style", "WSD"],
        ["--lr-decay-style WSD needs --lr-wsd-decay-iters"],
    ),
    case(
        "wsd_needs_anneal_samples",
        ["--train-samples", 100, "--lr-decay-style", "WSD"],
        ["--lr-decay-style WSD needs --lr-wsd-decay-samples"],
        **SAMPLES,
    ),
    case("lr_not_negative", ["--lr", -1e-3], ["--lr must be >= 0 (got -0.001)"]),
    case("min_lr_below_lr", ["--min-lr", 0.1], ["--min-lr (0.1) must be <= --lr (0.001)"]),
    case(
        "warmup_init_below_lr",
        ["--lr-warmup-init", 0.1],
        ["--lr-warmup-init (0.1) must be <= --lr (0.001)"],
    ),
    case(
        "decoupled_min_lr_below_decoupled_lr",
        ["--decoupled-lr", 1e-3, "--decoupled-min-lr", 1e-2],
        ["--decoupled-min-lr (0.01) must be <= --decoupled-lr (0.001)"],
    ),
    case(
        "constant_weight_decay_has_no_ends",
        ["--start-weight-decay", 0.1],
        ["--start-weight-decay/--end-weight-decay", "--weight-decay-incr-style", "constant"],
    ),
    case(
        "weight_decay_increment_needs_ends",
        ["--weight-decay-incr-style", "linear"],
        ["--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay"],
    ),
    # ------------------------------------------------------------ activation recompute
    case(
        "distributed_activations_need_tp",
        ["--distribute-saved-activations"],
        ["--distribute-saved-activations needs --tensor-model-parallel-size > 1"],
    ),
    case(
        "distributed_activations_need_full_recompute",
        ["--distribute-saved-activations", "--tensor-model-parallel-size", 2],
        ["--distribute-saved-activations needs --recompute-granularity full (got None)"],
        world_size=2,
    ),
    case(
        "distributed_activations_need_method",
        ["--distribute-saved-activations", "--tensor-model-parallel-size", 2]
        + ["--recompute-granularity", "full"],
        ["--distribute-saved-activations needs --recompute-method"],
        world_size=2,
    ),
    case(
        "distributed_activations_without_sequence_parallel",
        ["--distribute-saved-activations", "--tensor-model-parallel-size", 2, "--sequence-parallel"]
        + ["--recompute-granularity", "full", "--recompute-method", "uniform"],
        ["--distribute-saved-activations cannot be used with --sequence-parallel"],
        world_size=2,
    ),
    case(
        "selective_without_method",
        ["--recompute-activations", "--recompute-method", "uniform"],
        ["--recompute-method uniform cannot be used with --recompute-granularity selective"],
    ),
    case(
        "selective_without_num_layers",
        ["--recompute-granularity", "selective", "--recompute-num-layers", 2],
        ["--recompute-num-layers 2 cannot be used with --recompute-granularity selective"],
    ),
    case(
        "full_needs_method",
        ["--recompute-granularity", "full"],
        ["--recompute-granularity full needs --recompute-method uniform or block"],
    ),
    case(
        "full_needs_num_layers",
        ["--recompute-granularity", "full", "--recompute-method", "block"],
        ["--recompute-granularity full needs --recompute-num-layers"],
    ),
    case(
        "uniform_chunks_at_least_one_layer",
        ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        + ["--recompute-num-layers", 0],
        ["--recompute-num-layers (0) must be in [1, 4] with --recompute-method uniform"],
    ),
    case(
        "block_at_most_the_stage",
        ["--recompute-granularity", "full", "--recompute-method", "block"]
        + ["--recompute-num-layers", 5],
        ["--recompute-num-layers (5) must be in [0, 4] with --recompute-method block"],
    ),
    case(
        "method_needs_full",
        ["--recompute-method", "block"],
        ["--recompute-method/--recompute-num-layers need --recompute-granularity full"],
    ),
    case(
        "layout_characters",
        ["--pipeline-model-parallel-size", 2, "--pipeline-model-parallel-layout", "Et|tx|ttL"],
        ["--pipeline-model-parallel-layout 'Et|tx|ttL': unknown layer character 'x'"],
        world_size=2,
    ),
    case(
        "layout_stages_per_rank",
        ["--pipeline-model-parallel-size", 2, "--pipeline-model-parallel-layout", "Et|t|ttL"],
        ["--pipeline-model-parallel-layout 'Et|t|ttL' has 3 stages", "(2)"],
        world_size=2,
    ),
    case(
        "layout_layer_count",
        ["--pipeline-model-parallel-size", 2, "--pipeline-model-parallel-layout", "E(t)*2|tL"],
        ["holds 3 transformer layers (t), --num-layers is 4"],
        world_size=2,
    ),
    case(
        "layout_embedding_first",
        ["--pipeline-model-parallel-size", 2, "--pipeline-model-parallel-layout", "tEt|ttL"],
        ["'tEt|ttL': the first layer must be the embedding E"],
        world_size=2,
    ),
    case(
        "layout_not_with_uneven_split",
        ["--pipeline-model-parallel-size", 2, "--pipeline-model-parallel-layout", "Ett|ttL"]
        + ["--decoder-first-pipeline-num-layers", 2],
        ["--pipeline-model-parallel-layout cannot be combined with --decoder-first"],
        world_size=2,
    ),
    case(
        "layout_not_with_accounting",
        ["--pipeline-model-parallel-size", 2, "--pipeline-model-parallel-layout", "Ett|ttL"]
        + ["--account-for-loss-in-pipeline-split"],
        ["--pipeline-model-parallel-layout cannot be combined with --account-for"],
        world_size=2,
    ),
    case(
        "layout_standalone_mtp",
        ["--pipeline-model-parallel-size", 2, "--pipeline-model-parallel-layout", "Ett|tt|m|L"]
        + ["--mtp-num-layers", 1, "--position-embedding-type", "rope"],
        ["not supported yet: --pipeline-model-parallel-layout", "standalone MTP stage"],
        world_size=2,
    ),
    case(
        "known_recompute_modules",
        ["--recompute-modules", "attention"],
        ["--recompute-modules: unknown module 'attention'", "core_attn"],
    ),
    case(
        "mla_up_proj_needs_mla",
        ["--recompute-activations", "--recompute-modules", "mla_up_proj"],
        ["--recompute-modules mla_up_proj needs --multi-latent-attention"],
    ),
    case(
        "offload_modules_known",
        ["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "mlp"],
        ["--offload-modules: unknown module 'mlp'", "attn_norm"],
    ),
    case(
        "offload_attn_proj_needs_core_attn",
        ["--fine-grained-activation-offloading", "--offload-modules", "attn_proj"],
        ["--offload-modules attn_proj needs core_attn"],
    ),
    case(
        "offload_not_with_cpu_offloading",
        ["--fine-grained-activation-offloading", "--cpu-offloading-num-layers", 1],
        ["--fine-grained-activation-offloading cannot be combined with --cpu-offloading"],
    ),
    case(
        "offload_min_size",
        ["--fine-grained-activation-offloading", "--min-offloaded-tensor-size", -1],
        ["--min-offloaded-tensor-size must be >= 0 (got -1)"],
    ),
    # ------------------------------------------------------------ data and tokenizer
    case(
        "one_data_source",
        ["--data-path", "corpus"],
        ["only one data source can be given, got --mock-data and --data-path"],
    ),
    case(
        "data_path_and_args_path",
        ["--data-path", "corpus", "--data-args-path", "args.txt"],
        ["--data-path and --data-args-path are mutually exclusive"],
        drop=("--mock-data",),
    ),
    case(
        "per_split_paths_and_args_path",
        ["--train-data-path", "a", "--per-split-data-args-path", "b.json"],
        ["--train-data-path and --per-split-data-args-path are mutually exclusive"],
        drop=("--mock-data",),
    ),
    case("num_workers_not_negative", ["--num-workers", -1], ["--num-workers must be >= 0"]),
    case(
        "dataset_builder_threads_positive",
        ["--num-dataset-builder-threads", 0],
        ["--num-dataset-builder-threads must be > 0 (got 0)"],
    ),
    case("fim_no_mock", ["--fim-data"], ["--fim-data does not work with --mock-data"]),
    case(
        "fim_rate_nonzero",
        ["--fim-data", "--data-path", "d", "--fim-rate", 0],
        ["--fim-data needs a non-zero --fim-rate"],
        drop=["--mock-data"],
    ),
    case(
        "fim_spm_rate_nonzero",
        ["--fim-data", "--data-path", "d", "--fim-spm-rate", 0],
        ["--fim-data needs a non-zero --fim-spm-rate"],
        drop=["--mock-data"],
    ),
    case(
        "fim_rate_probability",
        ["--fim-data", "--data-path", "d", "--fim-fragment-rate", 1.5],
        ["--fim-fragment-rate is a probability, between 0 and 1 (got 1.5)"],
        drop=["--mock-data"],
    ),
    case(
        "fim_split_needs_fragment_rate",
        ["--fim-data", "--data-path", "d", "--fim-split-sample", "x"],
        ["--fim-split-sample needs --fim-fragment-rate"],
        drop=["--mock-data"],
    ),
    # ------------------------------------------------------------ logging and exits
    case("log_interval_positive", ["--log-interval", 0], ["--log-interval must be > 0 (got 0)"]),
    case(
        "tensorboard_log_interval_positive",
        ["--tensorboard-log-interval", 0],
        ["--tensorboard-log-interval must be > 0 (got 0)"],
    ),
    case(
        "memory_log_on_log_lines",
        ["--log-interval", 10, "--log-memory-interval", 15],
        ["--log-memory-interval (15)", "--log-interval (10)"],
    ),
    case(
        "wandb_project_needs_name",
        ["--wandb-project", "p"],
        ["--wandb-project needs --wandb-exp-name"],
    ),
    case("eval_interval_positive", ["--eval-interval", 0], ["--eval-interval must be > 0"]),
    case("eval_iters_not_negative", ["--eval-iters", -1], ["--eval-iters must be >= 0 (got -1)"]),
    case("exit_interval_positive", ["--exit-interval", 0], ["--exit-interval must be > 0"]),
    case(
        "exit_duration_positive",
        ["--exit-duration-in-mins", 0],
        ["--exit-duration-in-mins must be > 0 (got 0"],
    ),
    # ------------------------------------------------------------ misc
    case(
        "deterministic_without_flash",
        ["--deterministic-mode", "--use-flash-attn"],
        ["--deterministic-mode cannot be combined with --use-flash-attn"],
    ),
    case(
        "deterministic_without_fused_cross_entropy",
        ["--deterministic-mode", "--cross-entropy-loss-fusion"],
        ["--deterministic-mode cannot be combined with --cross-entropy-loss-fusion"],
    ),
    case(
        "cp_comm_type_per_layer",
        ["--cp-comm-type", "p2p", "p2p"],
        ["--cp-comm-type takes one value or one per layer (4), got 2"],
    ),
    case(
        "linear_attention_freq_without_variant",
        ["--linear-attention-freq", 2],
        ["--linear-attention-freq needs --experimental-attention-variant gated_delta_net"],
    ),
    case(
        "gated_delta_net_without_pattern",
        GDN,
        ["--experimental-attention-variant gated_delta_net needs --linear-attention-freq"],
    ),
    case(
        "gated_delta_net_pattern_length",
        GDN + ["--linear-attention-freq", "[1,0]"],
        ["--linear-attention-freq has 2 entries for 4 layers"],
    ),
    case(
        "gated_delta_net_value_heads",
        GDN + ["--linear-attention-freq", 2, "--linear-num-key-heads", 3],
        ["--linear-num-value-heads (32) must be a multiple of --linear-num-key-heads (3)"],
    ),
    case(
        "gated_delta_net_heads_over_tp",
        GDN
        + ["--linear-attention-freq", 2, "--tensor-model-parallel-size", 2]
        + ["--linear-num-key-heads", 1, "--linear-num-value-heads", 2],
        ["--linear-num-key-heads (1) must be divisible by --tensor-model-parallel-size (2)"],
        world_size=2,
    ),
    case(
        "gated_delta_net_without_cp",
        GDN + ["--linear-attention-freq", 2, "--context-parallel-size", 2],
        ["gated_delta_net does not support --context-parallel-size > 1"],
        world_size=2,
    ),
    case(
        "compiled_layers_without_recompute",
        ["--compile-transformer-layers", "--recompute-activations"],
        ["--compile-transformer-layers cannot be combined with --recompute-granularity selective"],
    ),
    case(
        "compiled_layers_without_dropout_under_tp",
        [
            "--compile-transformer-layers",
            "--tensor-model-parallel-size",
            2,
            "--hidden-dropout",
            0.1,
        ],
        ["--compile-transformer-layers needs --hidden-dropout 0 and --attention-dropout 0"],
        world_size=2,
    ),
]

# Each tokenizer type and the files it cannot do without.
TOKENIZER_NEEDS = {
    "GPT2BPETokenizer": "--vocab-file and --merge-file",
    "BertWordPieceLowerCase": "--vocab-file",
    "BertWordPieceCase": "--vocab-file",
    "SentencePieceTokenizer": "--tokenizer-model",
    "GPTSentencePieceTokenizer": "--tokenizer-model",
    "Llama2Tokenizer": "--tokenizer-model",
    "HuggingFaceTokenizer": "--tokenizer-model",
    "TikTokenizer": "--tokenizer-model",
    "NullTokenizer": "--vocab-size",
}
CASES += [
    case(
        f"tokenizer_{kind}_needs_files",
        ["--tokenizer-type", kind],
        [f"--tokenizer-type {kind} needs {needs}"],
        drop=("--tokenizer-type", "--vocab-size"),
    )
    for kind, needs in TOKENIZER_NEEDS.items()
]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)


def _words_in_order(words):
    return ".*".join(re.escape(word) for word in words)


@pytest.mark.parametrize("extra, words, world_size, drop, env", CASES)
def test_rule(extra, words, world_size, drop, env, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentValidationError, match=_words_in_order(words)):
        tiny_args(*extra, world_size=world_size, drop=drop)


def test_tiny_command_line_passes_every_rule():
    """The base of every case: each case fails because of its own flags only."""
    args = tiny_args()
    assert (args.num_layers, args.hidden_size, args.world_size) == (4, 64, 1)


# The modules of the pass whose rules these cases break (moe, numerics and rerun are tested on
# their own).
RULE_MODULES = (
    deprecated,
    parallel,
    shape,
    batch,
    pipeline,
    dp_strategy,
    precision,
    checkpoint,
    schedule,
    recompute,
    data,
    monitoring,
    layer,
)


def test_every_rule_has_a_case(monkeypatch):
    def run(param):
        extra, _, world_size, drop, env = param.values
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            tiny_args(*extra, world_size=world_size, drop=drop)

    fired = fired_rule_sites([functools.partial(run, param) for param in CASES], RULE_MODULES)
    sites = rule_sites(RULE_MODULES)
    assert len(sites) > 100  # the modules were read
    missing = sorted(sites - fired)
    assert not missing, f"rules without a case (file, line): {missing}"
