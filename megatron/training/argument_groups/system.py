"""Flags about where state lives: checkpointing, mixed precision, distributed layout."""

import os

from .builder import ArgGroup

CKPT_FORMATS = ["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"]
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
    for what in ("params", "activations", "tokens-per-expert", "wgrads", "dgrads"):
        g.int(
            f"--save-{what}-interval",
            None,
            f"Iterations between dumps of the {what.replace('-', ' ')} (debugging aid).",
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
    )
    g.int(
        "--override-ckpt-iteration",
        None,
        "Resume counting from this iteration instead of the checkpoint's.",
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
    g.no(
        "use-tokenizer-model-from-checkpoint-args",
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
    g._add(
        "--dist-ckpt-format",
        default=None,
        help="Deprecated, no effect: see --ckpt-format.",
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
        choices=["torch", "torch_dist"],
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
    g.true("--async-save", "Save checkpoints asynchronously.")
    g.str(
        "--async-strategy",
        "nvrx",
        "Implementation of asynchronous saves.",
        choices=["nvrx", "mcore"],
    )
    g.int("--async-ckpt-cpu-priority", 10, "CPU scheduling priority of the async writer.")
    g.int("--async-ckpt-io-priority", 3, "I/O priority of the async writer.")
    g.true("--async-ckpt-use-cpu-shm", "Stage async checkpoints in CPU shared memory.")
    g.true(
        "--ckpt-fully-parallel-load",
        "Spread distributed checkpoint reads over the data-parallel ranks.",
    )
    g.str(
        "--ckpt-fully-parallel-load-exchange-algo",
        "broadcast",
        "How ranks exchange what they read in a fully parallel load.",
        choices=["broadcast", "gather_rounds", "gather_object"],
    )
    g.true(
        "--ckpt-fully-parallel-load-per-rank-objects",
        "Each rank reads its own non-tensor objects in a fully parallel load.",
    )
    for what in ("save", "load"):
        g.str(
            f"--ckpt-fully-parallel-{what}-process-group",
            "dp",
            f"Group over which a fully parallel {what} is spread.",
            choices=["dp", "ep_dp"],
        )
    g.str("--ckpt-pg-tensors-cache-path", None, "Cache of the process-group tensors of a save.")
    g.true("--ckpt-pg-tensors-cache-create", "Write that cache.")
    g.no(
        "ckpt-load-validate-sharding-integrity",
        "Do not check that the loaded shards cover every tensor.",
    )
    g.no("strict-fsdp-dtensor-load", "Load fsdp_dtensor checkpoints non-strictly.")
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
    g.true(
        "--distrib-optim-fully-reshardable-mem-efficient",
        "Memory-efficient variant of --dist-ckpt-optim-fully-reshardable.",
    )
    g.true(
        "--dist-ckpt-save-pre-mcore-014",
        "Save distributed checkpoints in the layout of Megatron Core before 0.14.",
    )
    g.int("--dist-ckpt-workers", 1, "Writer processes per rank of a distributed save.")
    g.true(
        "--ckpt-drop-redundant-extra-state",
        "Do not save the replicated extra state of every rank.",
    )
    g.no("save-tokenizer-assets", "Do not copy the tokenizer files into the checkpoint.")
    g.true("--replication", "Replicate each rank's checkpoint on other nodes.")
    g.int("--replication-jump", None, "Rank distance between a checkpoint and its replica.")
    g.int("--replication-factor", 2, "Copies kept of each checkpoint.")
    g.true(
        "--verify-integrity",
        "Write a SHA-256 manifest of the checkpoint's files when saving and check it "
        "when loading; a changed or missing file ends the load.",
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
    g.str(
        "--output-logit-dtype",
        None,
        "Dtype of the output logits (default: the model's).",
        choices=["bf16", "fp32"],
        dest="logit_dtype",
    )
    g.true(
        "--disable-bf16-reduced-precision-matmul",
        "Keep bf16 matmuls from reducing in lower precision.",
    )
    g.true(
        "--reuse-grad-buf-for-mxfp8-param-ag",
        "Reuse the gradient buffer for the mxfp8 parameter all-gather.",
    )
    g.str(
        "--mamba-training-ssm-states-dtype",
        None,
        "Dtype of the Mamba SSM states in training.",
        choices=["fp32", "bf16"],
    )
    return parser


def _add_distributed_args(parser):
    g = ArgGroup(parser, "distributed")
    g.int("--tensor-model-parallel-size", 1, "Degree of tensor model parallelism.")
    g.int(
        "--tensor-parallel-num-weight-shards",
        None,
        "Shards of each weight across the tensor-parallel group.",
    )
    g.int("--pipeline-model-parallel-size", 1, "Degree of pipeline model parallelism.")
    g.str(
        "--pipeline-model-parallel-comm-backend",
        None,
        "Backend of the pipeline p2p communication.",
        choices=["nccl", "ucc"],
    )
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
    g.int("--model-parallel-size", None, "Removed: use --tensor-model-parallel-size.")
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
    g.no(
        "align-grad-reduce",
        "Let each pipeline stage launch its gradient reduction independently.",
    )
    g.int("--wgrad-deferral-limit", 0, "Micro-batches whose embedding wgrad may be deferred.")
    g.int("--ddp-num-buckets", None, "Number of data-parallel gradient buckets.")
    g.int("--ddp-bucket-size", None, "Data-parallel gradient bucket size (elements).")
    g.true("--ddp-pad-buckets-for-high-nccl-busbw", "Pad buckets to a large power of 2.")
    g.true(
        "--ddp-reduce-scatter-with-fp32-accumulation",
        "Accumulate the gradient reduce-scatter in fp32.",
    )
    g.true(
        "--gtp-remat-reduce-scatter-with-fp32-accumulation",
        "Accumulate the rematerialized reduce-scatter in fp32.",
    )
    g._add(
        "--ddp-param-name-patterns-for-fp32-local-accumulation",
        nargs="+",
        default=[],
        help="Parameters (name patterns) whose gradients accumulate locally in fp32.",
    )
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
    g.removed(
        "--no-scatter-gather-tensors-in-pipeline",
        "pipeline tensors are sent whole; drop the flag",
    )
    g.true("--use-ring-exchange-p2p", "Use the ring-exchange kernel for pipeline p2p.")
    g.int(
        "--local-rank",
        int(os.getenv("LOCAL_RANK", "0")),
        "Local rank passed by the launcher (default: $LOCAL_RANK).",
    )
    # torch.distributed.launch and older torchrun releases pass the underscore spelling.
    g.alias("--local_rank", "local_rank", type=int)
    g.true(
        "--lazy-mpu-init",
        "Skip the DDP setup in initialize_megatron and return a function that completes it.",
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
    g.true("--disable-symmetric-registration", "Do not register NCCL symmetric memory.")
    g.true("--gtp-remat-nccl-ub", "NCCL user buffers for the rematerialized communication.")
    g.true("--gtp-expert-remat-nccl-ub", "The same for expert layers.")
    g.list("--gtp-remat-opt-in-modules", [], "Modules whose communication is rematerialized.")
    g.true("--fsdp-manual-registration", "Register the FSDP buffers manually.")
    g.true("--create-all-gather-group", "Create a separate group for parameter all-gathers.")
    g.true("--use-sharp", "Enable SHARP collectives.")
    g.str(
        "--sharp-enabled-group",
        None,
        "Group that uses SHARP.",
        choices=["dp", "dp_replica"],
    )
    g.list("--high-priority-stream-groups", [], "Groups whose collectives run at high priority.")
    g.true("--use-megatron-fsdp", "Use Megatron-FSDP.")
    g.int("--megatron-fsdp-version", 1, "Megatron-FSDP implementation version.", choices=[1, 2])
    g.false(
        "--no-use-layer-wise-param-layout",
        "use_layer_wise_param_layout",
        "Megatron-FSDP: do not lay the parameter buffers out layer by layer.",
    )
    g.str(
        "--outer-dp-sharding-strategy",
        "no_shard",
        "Sharding across the outer data-parallel group (hybrid FSDP).",
        choices=["no_shard", "optim"],
    )
    g.false(
        "--no-gradient-reduce-div-fusion",
        "gradient_reduce_div_fusion",
        "Divide the gradients separately from their reduction.",
    )
    g.true("--fsdp-double-buffer", "Megatron-FSDP: double-buffer the parameter gathers.")
    g.int(
        "--suggested-communication-unit-size",
        None,
        "Megatron-FSDP: elements per communication unit.",
    )
    g.true("--keep-fp8-transpose-cache", "Keep the fp8 transpose cache between steps.")
    g.true("--enable-full-sharding-in-hsdp", "Shard fully inside each hybrid-FSDP replica.")
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
    )
    g.int(
        "--max-seqlen-per-dp-cp-rank",
        None,
        "Largest sequence length one DP x CP rank holds (hybrid context parallelism).",
    )
    g.true(
        "--hybrid-context-parallel",
        "Balance variable-length sequences over data- and context-parallel ranks.",
    )
    g.list(
        "--hierarchical-context-parallel-sizes",
        None,
        "Sizes of the hierarchical context-parallel levels (product = context-parallel size).",
        type=int,
    )
    g.str("--nccl-communicator-config-path", None, "YAML file with NCCL communicator settings.")
    g.true("--use-tp-pp-dp-mapping", "Rank order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp.")
    g.false(
        "--disable-gloo-process-groups",
        "use_gloo_process_groups",
        "Do not create gloo copies of the process groups.",
    )
    g.true("--fake-process-group", "Use a fake process group (no communication; testing aid).")
    g.int(
        "--distributed-timeout-seconds-after-init",
        None,
        "Timeout of collectives once initialization is over (seconds).",
    )
    g.true("--disable-jit-fuser", "Do not use the TorchScript/nvFuser JIT fusions.")
    _add_flight_recorder_args(g)
    _add_tp_comm_overlap_args(g)
    return parser


def _add_flight_recorder_args(g):
    g.str("--flight-recorder-dump-path", None, "Where NCCL's flight recorder dumps its trace.")
    g.int("--flight-recorder-trace-buffer-size", 2000, "Entries kept by the flight recorder.")
    g.no("flight-recorder-dump-on-timeout", "Do not dump the flight recorder on a timeout.")
    g.true("--flight-recorder-include-stack-trace", "Record stack traces in the flight recorder.")
    g.no("flight-recorder-include-only-active", "Dump finished collectives too.")
    g.no("flight-recorder-extra-dump-on-exec", "No extra dump when an exception is raised.")


def _add_tp_comm_overlap_args(g):
    g.true("--tp-comm-overlap", "Overlap tensor-parallel communication with GEMMs.")
    g.no("tp-comm-bulk-wgrad", "No bulk overlap of the wgrad GEMM with communication.")
    g.no("tp-comm-bulk-dgrad", "No bulk overlap of the dgrad GEMM with communication.")
    g.no("tp-comm-overlap-ag", "No overlap of the all-gather with GEMMs.")
    g.no("tp-comm-overlap-rs", "No overlap of the reduce-scatter with GEMMs.")
    g.true("--tp-comm-overlap-rs-dgrad", "Overlap the reduce-scatter with the dgrad GEMM.")
    g.no("tp-comm-split-ag", "Do not split the overlapped all-gather into chunks.")
    g.no("tp-comm-split-rs", "Do not split the overlapped reduce-scatter into chunks.")
    g.str(
        "--tp-comm-bootstrap-backend",
        "nccl",
        "Backend that bootstraps the overlap buffers.",
        choices=["nccl", "mpi", "gloo"],
    )
