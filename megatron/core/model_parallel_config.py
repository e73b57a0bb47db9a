"""Configuration shared by every model-parallel component (Megatron Core's ``ModelParallelConfig``).

Field names and defaults follow Megatron Core so that code and scripts written for it read the
same here. Only the fields that this project uses or may soon use are present; they are plain
data and hold no process groups (those are passed explicitly where needed). Setting an attribute
that is not a field raises AttributeError (for TransformerConfig too).
"""

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch


@dataclass
class ModelParallelConfig:
    """Parallelism, precision and initialization settings of a model."""

    # ---------------------------------------------------------------- parallel sizes
    tensor_model_parallel_size: int = 1
    """Number of ranks a layer's weights are split across (intra-layer model parallelism)."""

    pipeline_model_parallel_size: int = 1
    """Number of pipeline stages the layer stack is split into (inter-layer model parallelism)."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank for the interleaved schedule; None means no interleaving."""

    sequence_parallel: bool = False
    """Split the norm/dropout/residual regions along the sequence dimension across the tensor
    parallel ranks. Requires tensor_model_parallel_size > 1."""

    context_parallel_size: int = 1
    """Number of ranks the sequence is split across inside attention (context parallelism)."""

    hierarchical_context_parallel_sizes: Optional[List[int]] = None
    """Sizes of the levels of hierarchical context parallelism (cp_comm_type 'a2a+p2p')."""

    expert_model_parallel_size: int = 1
    """Number of ranks the MoE experts are distributed over."""

    expert_tensor_parallel_size: Optional[int] = None
    """Tensor parallel size inside each expert; None means the same as
    tensor_model_parallel_size."""

    # ---------------------------------------------------------------- initialization
    perform_initialization: bool = True
    """Run the weight init methods when building the model. False (``--no-initialization``)
    leaves weights uninitialized, e.g. because a checkpoint is loaded right after."""

    use_cpu_initialization: bool = False
    """Build the full (unsplit) master weights on the CPU and copy each rank's shard from them,
    so the result does not depend on the parallel layout. At TP=1 weights are always built on
    the CPU with the default CPU generator (the caller moves the model to its device), which
    makes this flag a no-op at TP=1."""

    # ---------------------------------------------------------------- precision
    fp16: bool = False
    """Train with fp16 parameters and dynamic (or static) loss scaling."""

    bf16: bool = False
    """Train with bf16 parameters."""

    params_dtype: torch.dtype = torch.float32
    """dtype the model parameters are created in."""

    # The schedules' inputs from the trainer (timers, finalize_model_grads_func, grad_scale_func,
    # grad_sync_func, microbatch_group_size_per_vp_stage) are fields here because Megatron Core's
    # callers set them on the config: a schedule given no StepContext reads them here
    # (StepContext.from_config).
    # This project's trainer passes a StepContext and leaves them unset.

    timers: Optional[Callable] = None
    """Timers object (megatron.core.timers.Timers) used for optional fine-grained timing."""

    rng_tracker: Optional[Any] = None
    """RNG states tracker (megatron.core.tensor_parallel.random.RNGStatesTracker). With tensor
    parallelism, attention dropout (heads are split across ranks) and, with sequence parallelism,
    hidden dropout (the sequence is split) draw from its per-TP-rank model-parallel stream, as in
    Megatron. None uses the default generator."""

    finalize_model_grads_func: Optional[Callable] = None
    """Called by the schedule after all micro-batches to reduce gradients across ranks."""

    grad_scale_func: Optional[Callable] = None
    """Scales the loss before backward (fp16 loss scaling); None means no scaling."""

    no_sync_func: Optional[Callable] = None
    """Context manager factory that disables gradient synchronization (all but the last
    micro-batch)."""

    grad_sync_func: Optional[Callable] = None
    """Starts the gradient reduction of a model chunk (overlap with the pipeline schedule)."""

    param_sync_func: Optional[Callable] = None
    """Starts the parameter all-gather of a model chunk (distributed optimizer overlap)."""

    # ---------------------------------------------------------------- pipeline details
    pipeline_dtype: Optional[torch.dtype] = None
    """dtype of the activations sent between pipeline stages; None means params_dtype."""

    variable_seq_lengths: bool = False
    """Micro-batches may have different sequence lengths; the schedule then exchanges shapes
    first."""

    overlap_p2p_comm: bool = False
    """Overlap pipeline send/receive with compute (interleaved schedule)."""

    batch_p2p_comm: bool = True
    """Group the pipeline sends and receives of one step into one batch_isend_irecv call."""

    deallocate_pipeline_outputs: bool = False
    """Free the data of an output tensor once it has been sent to the next stage (only its grad_fn
    is kept for backward)."""

    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Micro-batches run on one virtual stage before switching to the next; None means PP size."""

    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None
    """With full recompute and the pipeline schedule: how many micro-batches recompute only part
    of their layers."""

    # ---------------------------------------------------------------- fusions / overlap
    gradient_accumulation_fusion: bool = False
    """Accumulate weight gradients straight into ``param.main_grad`` in the linear layers'
    backward (``tensor_parallel.layers.LinearWithGradAccumulation``) instead of through ``.grad``
    and DDP's per-param hook; only weights wrapped by DDP (that have a ``main_grad``) take it."""

    tp_comm_overlap: bool = False
    """Overlap tensor-parallel communication with GEMMs (Transformer Engine userbuffers)."""

    defer_embedding_wgrad_compute: bool = False
    """Defer the output layer's weight-gradient GEMM to overlap it with the pipeline flush."""

    wgrad_deferral_limit: int = 0
    """How many micro-batches of deferred output-layer weight gradients to keep; 0 means all."""

    enable_autocast: bool = False
    """Run forward under torch.autocast with autocast_dtype."""

    autocast_dtype: Optional[torch.dtype] = None
    """dtype used when enable_autocast is set; None means params_dtype."""

    barrier_with_L1_time: bool = True
    """Put a barrier before the level-1 timers stop so they measure the slowest rank."""

    use_te_rng_tracker: bool = False
    """Use Transformer Engine's RNG tracker (not available in this project)."""

    def __setattr__(self, name: str, value: Any) -> None:
        # A misspelt field, or state another layer hides on the config, fails where it is set.
        if name not in self.__dataclass_fields__:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        super().__setattr__(name, value)

    def __post_init__(self):
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.virtual_pipeline_model_parallel_size is not None:
            if self.virtual_pipeline_model_parallel_size < 1:
                raise ValueError(
                    "virtual_pipeline_model_parallel_size must be None or >= 1, got "
                    f"{self.virtual_pipeline_model_parallel_size}"
                )
        if self.sequence_parallel and self.tensor_model_parallel_size <= 1:
            raise ValueError(
                "sequence_parallel requires tensor_model_parallel_size > 1 "
                "(--sequence-parallel needs --tensor-model-parallel-size > 1)"
            )
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 are mutually exclusive (--fp16 / --bf16)")
        if (
            not isinstance(self.params_dtype, torch.dtype)
            or not self.params_dtype.is_floating_point
        ):
            raise ValueError(
                f"params_dtype must be a floating torch.dtype, got {self.params_dtype!r}"
            )
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.pipeline_dtype is None:
            self.pipeline_dtype = self.params_dtype
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
