"""Flags about where state lives: checkpointing, mixed precision, distributed layout."""

import os

from .builder import ArgGroup

CKPT_FORMATS = ["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"]
DIST_CKPT_STRICTNESS = [
    "assume_ok_unexpected",
    "log_unexpected",
    "log_all",
    "raise_unexpected",
    "raise_all",
    "return_unexpected",
    "return_all",
    "ignore_all",
]


def _add_checkpointing_args(parser):
    g = ArgGroup(parser, "checkpointing")
    g.str("--save", None, "Directory to save checkpoints to.")
    g.int(
        ("--save-interval", "--persistent-save-interval"),
        None,
        "Iterations between checkpoint saves.",
    )
    g.int(
        "--save-retain-interval",
        None,
        "Keep only checkpoints at multiples of this interval (and the latest); delete the others.",
    )
    g.true("--no-save-optim", "Do not save the optimizer state.", default=None)
    g.true("--no-save-rng", "Do not save the RNG state.", default=None)
    g.str("--load", None, "Directory holding the checkpoint to load.")
    g.true("--no-load-optim", "Do not load the optimizer state.", default=None)
    g.true(
        "--load-main-params-from-ckpt",
        "Load the fp32 main parameters from the checkpoint (needs --no-load-optim).",
        default=None,
    )
    g.true("--no-load-rng", "Do not load the RNG state.", default=None)
    g.int("--non-persistent-save-interval", None, "Iterations between non-persistent saves.")
    g.str(
        "--non-persistent-ckpt-type",
        None,
        "Kind of non-persistent checkpoint.",
        choices=["global", "local", "in_memory"],
    )
    g.str(
        "--non-persistent-global-ckpt-dir", None, "Directory of global non-persistent checkpoints."
    )
    g.str("--non-persistent-local-ckpt-dir", None, "Directory of local non-persistent checkpoints.")
    g.str(
        "--non-persistent-local-ckpt-algo",
        "fully_parallel",
        "Local checkpoint algorithm.",
        choices=["fully_parallel", "atomic"],
    )
    g.true("--finetune", "Load weights only (no optimizer/RNG state) and restart at iteration 0.")
    g.str("--pretrained-checkpoint", None, "Checkpoint to start fine-tuning from.")
    g.int("--ckpt-step", None, "Load this iteration instead of the latest.")
    g.false(
        "--no-initialization",
        "perform_initialization",
        "Skip weight initialization (when a checkpoint will be loaded anyway).",
    )
    g.true("--use-checkpoint-args", "Override model flags with those stored in the checkpoint.")
    g.true("--use-mp-args-from-checkpoint-args", "Take the parallel sizes from the checkpoint.")
    g.false(
        "--no-use-tokenizer-model-from-checkpoint-args",
        "use_tokenizer_model_from_checkpoint_args",
        "Do not take the tokenizer model path from the checkpoint args.",
    )
    g.true(
        "--exit-on-missing-checkpoint",
        "Exit if --load holds no checkpoint instead of starting from random weights.",
    )
    g.true(
        "--use-dist-ckpt",
        "Deprecated, no effect: see --ckpt-format.",
        dest="use_dist_ckpt_deprecated",
    )
    g.true("--use-persistent-ckpt-worker", "Use a persistent worker process for async saves.")
    g.true("--auto-detect-ckpt-format", "Detect the format of the checkpoint being loaded.")
    g.str(
        "--dist-ckpt-format",
        None,
        "Deprecated, no effect: see --ckpt-format.",
        dest="dist_ckpt_format_deprecated",
    )
    g.str(
        "--ckpt-format",
        "torch_dist",
        "Checkpoint format: torch (torch.save files per rank) or a distributed format.",
        choices=CKPT_FORMATS,
    )
    g.str(
        "--ckpt-convert-format",
        None,
        "Convert the loaded checkpoint to this format.",
        choices=["torch", "torch_dist", "zarr"],
    )
    g.str("--ckpt-convert-save", None, "Directory for the converted checkpoint.")
    g.true(
        "--ckpt-convert-update-legacy-dist-opt-format",
        "Update a legacy distributed optimizer checkpoint when loading.",
    )
    g.true(
        "--ckpt-fully-parallel-save",
        "Deprecated, no effect: see --no-ckpt-fully-parallel-save.",
        dest="ckpt_fully_parallel_save_deprecated",
    )
    g.false(
        "--no-ckpt-fully-parallel-save",
        "ckpt_fully_parallel_save",
        "Do not spread distributed checkpoint writes over the data-parallel ranks.",
    )
    g.true("--async-save", "Save checkpoints asynchronously.", default=None)
    g.true(
        "--ckpt-fully-parallel-load",
        "Spread distributed checkpoint reads over the data-parallel ranks.",
    )
    g.true(
        "--ckpt-assume-constant-structure",
        "The state dict structure never changes during the job (enables caching).",
    )
    g.str(
        "--dist-ckpt-strictness",
        "assume_ok_unexpected",
        "Key-mismatch handling when loading a distributed checkpoint.",
        choices=DIST_CKPT_STRICTNESS,
    )
    g.true(
        "--dist-ckpt-optim-fully-reshardable",
        "Make the optimizer state reshardable across every parallel dimension.",
    )
    return parser


def _add_mixed_precision_args(parser):
    g = ArgGroup(parser, "mixed precision")
    g.true("--fp16", "Train in fp16 with loss scaling.")
    g.true("--bf16", "Train in bfloat16.")
    g.true("--grad-reduce-in-bf16", "Reduce gradients in bfloat16.")
    g.float("--loss-scale", None, "Static loss scale (power of 2); None: dynamic scaling.")
    g.float("--initial-loss-scale", 2**32, "Initial dynamic loss scale.")
    g.float("--min-loss-scale", 1.0, "Minimum dynamic loss scale.")
    g.float("--loss-scale-window", 1000, "Clean steps before the dynamic scale grows.")
    g.int("--hysteresis", 2, "Overflow steps tolerated before the dynamic scale shrinks.")
    g.true("--fp32-residual-connection", "Keep the residual stream in fp32.")
    g.true(
        "--apply-query-key-layer-scaling",
        "Scale Q.K^T by 1/layer-number (fp16 aid); implies --attention-softmax-in-fp32.",
    )
    g.true("--attention-softmax-in-fp32", "Compute attention masking and softmax in fp32.")
    g.true(
        "--accumulate-allreduce-grads-in-fp32",
        "Accumulate and all-reduce gradients in fp32 (always on with --bf16).",
    )
    g.true("--fp16-lm-cross-entropy", "Compute the LM cross entropy in fp16.")
    return parser


def _add_distributed_args(parser):
    g = ArgGroup(parser, "distributed")
    g.int("--tensor-model-parallel-size", 1, "Degree of tensor model parallelism.")
    g.int("--pipeline-model-parallel-size", 1, "Degree of pipeline model parallelism.")
    g.int(
        "--decoder-first-pipeline-num-layers",
        None,
        "Layers on the first pipeline stage (uneven split).",
    )
    g.int(
        "--decoder-last-pipeline-num-layers",
        None,
        "Layers on the last pipeline stage (uneven split).",
    )
    g.str(
        "--pipeline-model-parallel-layout", None, 'Custom pipeline layout, e.g. "E|(t|)*3,m|m||L".'
    )
    g.removed("--model-parallel-size", "use --tensor-model-parallel-size")
    g.int("--num-layers-per-virtual-pipeline-stage", None, "Layers per virtual pipeline stage.")
    g.int("--num-virtual-stages-per-pipeline-rank", None, "Virtual pipeline stages per rank.")
    g.int(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        None,
        "Consecutive micro-batches per virtual stage (default: pipeline size).",
        dest="microbatch_group_size_per_vp_stage",
    )
    g.false(
        "--no-overlap-p2p-communication",
        "overlap_p2p_comm",
        "Do not overlap pipeline communication with compute.",
    )
    g.true(
        "--overlap-p2p-communication-warmup-flush",
        "Also overlap pipeline communication in warm-up and flush.",
        dest="overlap_p2p_comm_warmup_flush",
    )
    g.str("--distributed-backend", "nccl", "torch.distributed backend.", choices=["nccl", "gloo"])
    g.int("--distributed-timeout-minutes", 10, "Timeout of torch.distributed operations.")
    g.true("--overlap-grad-reduce", "Overlap the gradient reduction with backward.")
    g.true(
        "--defer-embedding-wgrad-compute",
        "Defer the output-layer weight gradient to the pipeline flush.",
    )
    g.false(
        "--no-align-grad-reduce",
        "align_grad_reduce",
        "Let each pipeline stage launch its gradient reduction independently.",
    )
    g.int("--ddp-num-buckets", None, "Number of data-parallel gradient buckets.")
    g.int("--ddp-bucket-size", None, "Data-parallel gradient bucket size (elements).")
    g.true("--ddp-pad-buckets-for-high-nccl-busbw", "Pad buckets to a large power of 2.")
    g.true(
        "--ddp-average-in-collective",
        "Average inside the collective instead of pre-scaling by 1/DP.",
    )
    g.true(
        "--overlap-param-gather",
        "Overlap the parameter all-gather with forward (distributed optimizer).",
    )
    g.true(
        "--overlap-param-gather-with-optimizer-step",
        "Overlap the first all-gather with the optimizer step.",
    )
    g.false(
        "--no-align-param-gather",
        "align_param_gather",
        "Let each pipeline stage launch its parameter all-gather independently.",
    )
    g.false(
        "--no-scatter-gather-tensors-in-pipeline",
        "scatter_gather_tensors_in_pipeline",
        "Do not scatter/gather tensors sent between pipeline stages.",
    )
    g.true("--use-ring-exchange-p2p", "Use the ring-exchange kernel for pipeline p2p.")
    g.int(
        ("--local-rank", "--local_rank"),
        int(os.getenv("LOCAL_RANK", "0")),
        "Local rank passed by the launcher (default: $LOCAL_RANK).",
    )
    g._add(
        "--lazy-mpu-init",
        type=bool,
        required=False,
        help="Skip the DDP setup in initialize_megatron and return a function that completes it.",
    )
    g.true(
        "--account-for-embedding-in-pipeline-split",
        "Count the input embedding as a layer when splitting layers over pipeline stages.",
    )
    g.true(
        "--account-for-loss-in-pipeline-split",
        "Count the loss as a layer when splitting layers over pipeline stages.",
    )
    g.true(
        "--use-distributed-optimizer",
        "Shard the optimizer state over data-parallel ranks (ZeRO-1).",
    )
    g.int(
        "--num-distributed-optimizer-instances",
        1,
        "Distributed optimizer copies across the data-parallel domain.",
    )
    g.true("--use-nccl-ub", "Register NCCL user buffers for DP communication.", dest="nccl_ub")
    g.true("--use-sharp", "Enable SHARP collectives.")
    g.true("--use-megatron-fsdp", "Use Megatron-FSDP.")
    g.true("--init-model-with-meta-device", "Create the model on the meta device.")
    g.str(
        "--data-parallel-sharding-strategy",
        "optim_grads_params",
        "Megatron-FSDP sharding.",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
    )
    g.true("--use-torch-fsdp2", "Use torch FSDP2 (fully_shard).")
    g.false(
        "--torch-fsdp2-no-reshard-after-forward",
        "torch_fsdp2_reshard_after_forward",
        "Keep parameters gathered after forward (FSDP2 ZeRO-2).",
    )
    g.int("--context-parallel-size", 1, "Degree of context parallelism.")
    g.list(
        "--cp-comm-type",
        ["p2p"],
        "Context-parallel communication: p2p, a2a, allgather or "
        "a2a+p2p (one value, or one per layer).",
        choices=["p2p", "a2a", "allgather", "a2a+p2p"],
    )
    g.list(
        "--hierarchical-context-parallel-sizes",
        None,
        "Sizes of the hierarchical context-parallel levels (product = context-parallel size).",
        type=int,
    )
    g.str("--nccl-communicator-config-path", None, "YAML file with NCCL communicator settings.")
    g.true("--use-tp-pp-dp-mapping", "Rank order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp.")
    return parser
