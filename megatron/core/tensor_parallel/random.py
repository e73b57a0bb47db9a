"""Named RNG streams for model-parallel regions (Megatron's CUDA RNG tracker, device-agnostic),
and the activation-checkpoint function that replays them.

Some random ops must differ across tensor-parallel ranks (dropout inside a TP-split region,
init of weight shards) while others must agree (dropout on replicated activations). The
tracker keeps one generator state per name; ``fork(name)`` swaps that state into the device's
default generator for the duration of a block and stores the advanced state back afterwards.

Layers take their tracker explicitly; the one module-level tracker (megatron-core's
``get_cuda_rng_tracker()``) lives in the section "Megatron Core's module-level tracker".

Seeds (Megatron's ``model_parallel_cuda_manual_seed``):
  data-parallel region  = seed
  tensor-parallel region = seed + 2718 + tp_rank
  expert region          = seed + 1024 + 100 * ep_rank + etp_rank
"""

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Union

import torch

from megatron.core import parallel_state
from megatron.core.device import compute_device
from megatron.core.tensor_parallel import collectives

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"


def _resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    if device is None:
        return compute_device()
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"RNGStatesTracker supports 'cpu' and 'cuda' devices, got {device}")
    return device


def get_device_rng_state(device: torch.device) -> torch.Tensor:
    """State of the default generator of ``device`` (a CUDA device without index: the current
    one)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device if device.index is not None else "cuda")
    return torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device if device.index is not None else "cuda")
    else:
        torch.set_rng_state(state)


def manual_seed_device(seed: int, device: torch.device) -> None:
    """Seed only the default generator of ``device`` (not every device, unlike
    torch.manual_seed)."""
    if device.type == "cuda":
        if device.index is None:
            torch.cuda.manual_seed(seed)  # the current device
        else:
            with torch.cuda.device(device.index):
                torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states for one device's default generator."""

    def __init__(self, device: Union[str, torch.device, None] = None):
        """``device``: 'cpu', 'cuda' / 'cuda:N', or None for the compute device."""
        self.device = _resolve_device(device)
        self.reset()

    def reset(self) -> None:
        """Forget all states and seeds."""
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self) -> Dict[str, torch.Tensor]:
        """Copies of the states, for checkpoints (``rng_tracker_states``)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the states (from :meth:`get_states` of a checkpoint)."""
        for name, state in states.items():
            if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
                raise ValueError(
                    f"RNG tracker state {name!r} must be a uint8 tensor, got {type(state).__name__}"
                )
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create the stream ``name`` seeded with ``seed``; names and seeds must be new."""
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"RNG tracker: state {name!r} already exists")
        self.seeds_.add(seed)
        if self.device.type == "cuda":
            # Seed the device generator, capture its state, restore the caller's state.
            saved = get_device_rng_state(self.device)
            manual_seed_device(seed, self.device)
            self.states_[name] = get_device_rng_state(self.device)
            set_device_rng_state(saved, self.device)
        else:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block with the stream ``name`` in the device's default generator, then store
        the advanced stream and put the caller's generator state back (also on exceptions)."""
        if name not in self.states_:
            raise ValueError(
                f"RNG tracker: state {name!r} is not added (known: {sorted(self.states_)})"
            )
        saved = get_device_rng_state(self.device)
        set_device_rng_state(self.states_[name], self.device)
        try:
            yield
        finally:
            self.states_[name] = get_device_rng_state(self.device)
            set_device_rng_state(saved, self.device)


# Megatron's class name (its tracker is CUDA-only; this one follows its device).
CudaRNGStatesTracker = RNGStatesTracker


@dataclass(frozen=True)
class ModelParallelSeeds:
    """Seeds of the three tracked regions for one rank."""

    data_parallel: int
    tensor_model_parallel: int
    expert_parallel: int


def model_parallel_seed(
    seed: int, tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0
) -> ModelParallelSeeds:
    """Megatron's per-rank seeds: data-parallel = seed, TP region = seed + 2718 + tp_rank,
    expert region = seed + 1024 + 100 * ep_rank + etp_rank."""
    return ModelParallelSeeds(
        data_parallel=seed,
        tensor_model_parallel=seed + 2718 + tp_rank,
        expert_parallel=seed + 1024 + 100 * ep_rank + etp_rank,
    )


def model_parallel_manual_seed(
    tracker: RNGStatesTracker, seed: int, tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0
) -> ModelParallelSeeds:
    """Reset ``tracker`` and add the three Megatron streams for this rank; seed the tracker's
    device generator with the data-parallel seed (what ``model_parallel_cuda_manual_seed`` does).

    ``seed`` is the already rank-adjusted seed (Megatron: --seed + 100 * pp_rank).
    """
    seeds = model_parallel_seed(seed, tp_rank, ep_rank, etp_rank)
    tracker.reset()
    manual_seed_device(seeds.data_parallel, tracker.device)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seeds.data_parallel)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seeds.tensor_model_parallel)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seeds.expert_parallel)
    return seeds


# ---------------------------------------------------------------------------------------------
# Megatron Core's module-level tracker. The one piece of module-level RNG state in megatron/core:
# code written against megatron-core seeds it with model_parallel_cuda_manual_seed() and reads it
# with get_cuda_rng_tracker(); the training side reads the same object
# (megatron.training.global_vars.get_rng_tracker()). Layers are given their tracker
# (config.rng_tracker, rng_tracker=) and read this one only where a config names none, as
# megatron-core's layers do (megatron.core.transformer.utils.rng_tracker_of).
# ---------------------------------------------------------------------------------------------

_CURRENT_TRACKER: Optional[RNGStatesTracker] = None


def _no_special_tracker(what: str, **flags: bool) -> None:
    for name, value in flags.items():
        if value:
            raise ValueError(f"{what}: {name}=True is not supported (no Transformer Engine here)")


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> RNGStatesTracker:
    """The current tracker (megatron-core's name; it follows the compute device, CPU included).
    Created empty on first use; :func:`model_parallel_cuda_manual_seed` adds its streams."""
    global _CURRENT_TRACKER
    _no_special_tracker(
        "get_cuda_rng_tracker",
        use_te_rng_tracker=use_te_rng_tracker,
        inference_rng_tracker=inference_rng_tracker,
        use_cudagraphable_rng=use_cudagraphable_rng,
    )
    if _CURRENT_TRACKER is None:
        _CURRENT_TRACKER = RNGStatesTracker()
    return _CURRENT_TRACKER


def current_rng_tracker() -> Optional[RNGStatesTracker]:
    """The current tracker, or None when none was created or set."""
    return _CURRENT_TRACKER


def set_current_rng_tracker(tracker: Optional[RNGStatesTracker]) -> None:
    """Make ``tracker`` the current one (None: forget it)."""
    global _CURRENT_TRACKER
    _CURRENT_TRACKER = tracker


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: Optional[int] = None,
    ep_rank: Optional[int] = None,
    etp_rank: Optional[int] = None,
    force_reset_rng: bool = False,
) -> ModelParallelSeeds:
    """Megatron-core's seeding: a fresh current tracker on the compute device with the three
    streams of this rank (:func:`model_parallel_manual_seed`), the device generator seeded with
    ``seed``. Ranks left None come from the current ``parallel_state`` (0 without one)."""
    _no_special_tracker(
        "model_parallel_cuda_manual_seed",
        te_rng_tracker=te_rng_tracker,
        inference_rng_tracker=inference_rng_tracker,
        use_cudagraphable_rng=use_cudagraphable_rng,
    )
    state = parallel_state.current_parallel_state()
    if tp_rank is None:
        tp_rank = state.get_tensor_model_parallel_rank() if state is not None else 0
    if ep_rank is None:
        ep_rank = state.get_expert_model_parallel_rank() if state is not None else 0
    if etp_rank is None:
        etp_rank = state.get_expert_tensor_parallel_rank() if state is not None else 0
    tracker = RNGStatesTracker()
    set_current_rng_tracker(tracker)
    return model_parallel_manual_seed(tracker, seed, tp_rank, ep_rank, etp_rank)


# ---------------------------------------------------------------------------------------------
# Activation checkpointing that replays every random stream.
#
# A checkpointed segment runs its forward twice: once without saving activations, and again in
# backward to rebuild them. Dropout in the rerun must draw the same masks as in the first run,
# so the rerun starts from the generator states the first run started from: the CPU generator,
# the CUDA generator(s) in use and every named stream of the RNG tracker (dropout on tensor-
# parallel-split activations draws from the tracker's model-parallel stream). Afterwards the
# states of the moment of the rerun are put back, so the rest of training sees no difference.
# ---------------------------------------------------------------------------------------------


def _cuda_devices(tensors, tracker: Optional[RNGStatesTracker]) -> Tuple[torch.device, ...]:
    devices = {t.device for t in tensors if t.is_cuda}
    if tracker is not None and tracker.device.type == "cuda":
        devices.add(tracker.device)
    resolved = set()
    for device in devices:
        index = device.index if device.index is not None else torch.cuda.current_device()
        resolved.add(torch.device("cuda", index))
    return tuple(sorted(resolved, key=lambda d: d.index))


class RNGSnapshot:
    """The CPU generator, the given CUDA generators and every tracker stream at one moment."""

    def __init__(
        self, tracker: Optional[RNGStatesTracker], cuda_devices: Tuple[torch.device, ...] = ()
    ):
        self.tracker = tracker
        self.cpu_state = torch.get_rng_state()
        self.cuda_states = {device: torch.cuda.get_rng_state(device) for device in cuda_devices}
        self.tracker_states = tracker.get_states() if tracker is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_state)
        for device, state in self.cuda_states.items():
            torch.cuda.set_rng_state(state, device)
        if self.tracker is not None:
            self.tracker.set_states(self.tracker_states)


def _split_for_saving(tensor: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/size chunk of the flattened ``tensor`` (zero-padded to equal chunks), a
    copy."""
    size, rank = collectives.group_size(group), collectives.group_rank(group)
    flat = tensor.detach().reshape(-1)
    chunk = -(-flat.numel() // size)
    mine = flat.new_zeros(chunk)
    start = min(rank * chunk, flat.numel())
    end = min(start + chunk, flat.numel())
    mine[: end - start].copy_(flat[start:end])
    return mine


def _gather_saved(chunk: torch.Tensor, group, shape: torch.Size) -> torch.Tensor:
    size = collectives.group_size(group)
    full = chunk.new_empty(chunk.numel() * size)
    collectives.all_gather_into_tensor(full, chunk, group)
    numel = 1
    for dim in shape:
        numel *= dim
    return full[:numel].view(shape)


class _CheckpointOptions:
    """What the checkpoint function needs besides the segment's inputs."""

    def __init__(
        self,
        run_function: Callable,
        distribute_saved_activations: bool,
        rng_tracker: Optional[RNGStatesTracker],
        tp_group,
    ):
        self.run_function = run_function
        self.distribute = (
            bool(distribute_saved_activations) and collectives.group_size(tp_group) > 1
        )
        self.rng_tracker = rng_tracker
        self.tp_group = tp_group


class CheckpointFunction(torch.autograd.Function):
    """Runs a segment without keeping its activations and reruns it in backward.

    Only the inputs are saved; with ``distribute`` the first input (the hidden states, replicated
    across the tensor-parallel ranks) is saved as this rank's 1/TP chunk and all-gathered again
    before the rerun. ``anchor`` is an empty tensor that requires grad, so that backward reaches
    this function even when no input requires grad (the segment's parameters still need theirs).
    """

    @staticmethod
    def forward(ctx, options: _CheckpointOptions, anchor: torch.Tensor, *args):
        ctx.options = options
        tensors = [a for a in args if torch.is_tensor(a)]
        ctx.snapshot = RNGSnapshot(options.rng_tracker, _cuda_devices(tensors, options.rng_tracker))
        with torch.no_grad():
            outputs = options.run_function(*args)

        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.inputs_require_grad = [args[i].requires_grad for i in ctx.tensor_positions]
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in args]
        to_save = [args[i] for i in ctx.tensor_positions]
        ctx.distributed_shape = None
        if options.distribute and ctx.tensor_positions and ctx.tensor_positions[0] == 0:
            ctx.distributed_shape = args[0].shape
            to_save[0] = _split_for_saving(args[0], options.tp_group)
        ctx.save_for_backward(*to_save)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "checkpointed segments support .backward() only, not torch.autograd.grad()"
            )
        options = ctx.options
        saved = list(ctx.saved_tensors)
        if ctx.distributed_shape is not None:
            saved[0] = _gather_saved(saved[0], options.tp_group, ctx.distributed_shape)
        args = list(ctx.non_tensor_args)
        for position, tensor, requires_grad in zip(
            ctx.tensor_positions, saved, ctx.inputs_require_grad
        ):
            args[position] = tensor.detach().requires_grad_(requires_grad)

        now = RNGSnapshot(options.rng_tracker, tuple(ctx.snapshot.cuda_states))
        ctx.snapshot.restore()
        try:
            with torch.enable_grad():
                outputs = options.run_function(*args)
        finally:
            now.restore()

        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs)
            if torch.is_tensor(out) and out.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        input_grads = tuple(
            a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args
        )
        return (None, None) + input_grads


def checkpoint(
    function: Callable,
    distribute_saved_activations: bool,
    *args,
    rng_tracker: Optional[RNGStatesTracker] = None,
    tp_group=None,
):
    """``function(*args)`` whose activations are recomputed in backward (Megatron's
    ``tensor_parallel.checkpoint``).

    The recomputation replays the CPU, CUDA and ``rng_tracker`` random streams of the first run,
    so dropout masks (also those drawn from the tracker's per-TP-rank stream) are the same.
    ``distribute_saved_activations`` keeps only this rank's 1/TP share of ``args[0]`` (which must
    be identical on all ranks of ``tp_group``) until the recomputation. Outputs may be a tensor
    or a tuple (non-tensor entries such as None pass through). Without grad mode the function
    simply runs.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    options = _CheckpointOptions(function, distribute_saved_activations, rng_tracker, tp_group)
    anchor = torch.empty(0, requires_grad=True, device=compute_device())
    return CheckpointFunction.apply(options, anchor, *args)


class _OutputDiscardingFunction(torch.autograd.Function):
    """Forward of :class:`CheckpointWithoutOutput`: runs the function without a graph, keeps its
    inputs; backward runs autograd through the graph the hook recomputed."""

    @staticmethod
    def forward(ctx, owner: "CheckpointWithoutOutput", anchor: torch.Tensor, *args):
        with torch.no_grad():
            output = owner.function(*args)
        ctx.owner = owner
        ctx.save_for_backward(*args)
        owner.ctx = ctx
        return output

    @staticmethod
    def backward(ctx, grad_output):
        owner = ctx.owner
        if owner.recomputed is None:  # the output was kept: recompute here
            owner.recompute()
        output, inputs = owner.recomputed, owner.recomputed_inputs
        # Break the owner <-> graph cycle so the graph is freed as soon as backward is done.
        owner.recomputed = owner.recomputed_inputs = owner.ctx = owner.output = None
        ctx.owner = None
        torch.autograd.backward(output, grad_output)
        return (None, None) + tuple(x.grad if x.requires_grad else None for x in inputs)


class CheckpointWithoutOutput:
    """Megatron's output-discarding checkpoint (selective recompute of ``layernorm``).

    :meth:`checkpoint` runs a deterministic ``function`` of tensors (a norm) and keeps only its
    inputs. Once the consumers of the output have run, :meth:`discard_output_and_register_recompute`
    frees the output's storage (the consumers' saved copy of it included: it is the same tensor)
    and hooks the recomputation onto the gradient of a later tensor, so the storage is refilled,
    in place, before any consumer's backward reads it.
    """

    def __init__(self):
        self.function = None
        self.output = None
        self.ctx = None
        self.recomputed = None
        self.recomputed_inputs = None

    def checkpoint(self, function: Callable, *args: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return function(*args)
        self.function = function
        anchor = torch.empty(0, requires_grad=True, device=compute_device())
        self.output = _OutputDiscardingFunction.apply(self, anchor, *args)
        return self.output

    def recompute(self, *unused) -> None:
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in self.ctx.saved_tensors]
        with torch.enable_grad():
            recomputed = self.function(*inputs)
        storage = self.output.untyped_storage()
        if storage.size() == 0:
            # Refill the freed storage in place: the version counter stays, so the consumers'
            # saved reference to this tensor is valid again.
            storage.resize_(recomputed.untyped_storage().size())
            storage.copy_(recomputed.detach().untyped_storage())
        self.recomputed, self.recomputed_inputs = recomputed, inputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the output now; recompute it when ``hook_tensor``'s gradient is computed."""
        if self.output is None or not hook_tensor.requires_grad:
            return
        output = self.output
        if not output.is_contiguous() or output.storage_offset() != 0:
            return  # the storage may hold more than the output: keep it
        output.untyped_storage().resize_(0)
        hook_tensor.register_hook(self.recompute)
