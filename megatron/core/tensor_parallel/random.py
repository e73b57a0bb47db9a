"""Named RNG streams for model-parallel regions (Megatron's CUDA RNG tracker, device-agnostic).

Some random ops must differ across tensor-parallel ranks (dropout inside a TP-split region,
init of weight shards) while others must agree (dropout on replicated activations). The
tracker keeps one generator state per name; ``fork(name)`` swaps that state into the device's
default generator for the duration of a block and stores the advanced state back afterwards.

There is no module-level tracker: whoever sets up training owns one instance and passes it on.

Seeds (Megatron's ``model_parallel_cuda_manual_seed``):
  data-parallel region  = seed
  tensor-parallel region = seed + 2718 + tp_rank
  expert region          = seed + 1024 + 100 * ep_rank + etp_rank
"""

import contextlib
from dataclasses import dataclass
from typing import Dict, Union

import torch

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"


def _resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"RNGStatesTracker supports 'cpu' and 'cuda' devices, got {device}")
    return device


def get_device_rng_state(device: torch.device) -> torch.Tensor:
    """State of the default generator of ``device`` (a CUDA device without index: the current one)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device if device.index is not None else "cuda")
    return torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device if device.index is not None else "cuda")
    else:
        torch.set_rng_state(state)


def manual_seed_device(seed: int, device: torch.device) -> None:
    """Seed only the default generator of ``device`` (not every device, unlike torch.manual_seed)."""
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
        """``device``: 'cpu', 'cuda' / 'cuda:N', or None for CUDA when available else CPU."""
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
                raise ValueError(f"RNG tracker state {name!r} must be a uint8 tensor, got {type(state).__name__}")
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
            generator = torch.Generator()
            generator.manual_seed(seed)
            self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block with the stream ``name`` in the device's default generator, then store
        the advanced stream and put the caller's generator state back (also on exceptions)."""
        if name not in self.states_:
            raise ValueError(f"RNG tracker: state {name!r} is not added (known: {sorted(self.states_)})")
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


def model_parallel_seed(seed: int, tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0) -> ModelParallelSeeds:
    """Megatron's per-rank seeds: data-parallel = seed, TP region = seed + 2718 + tp_rank,
    expert region = seed + 1024 + 100 * ep_rank + etp_rank."""
    return ModelParallelSeeds(
        data_parallel=seed,
        tensor_model_parallel=seed + 2718 + tp_rank,
        expert_parallel=seed + 1024 + 100 * ep_rank + etp_rank,
    )


def model_parallel_manual_seed(tracker: RNGStatesTracker, seed: int, tp_rank: int = 0, ep_rank: int = 0,
                               etp_rank: int = 0) -> ModelParallelSeeds:
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


# Megatron's name for the same function.
def model_parallel_cuda_manual_seed(seed: int, tracker: RNGStatesTracker, tp_rank: int = 0, ep_rank: int = 0,
                                    etp_rank: int = 0) -> ModelParallelSeeds:
    return model_parallel_manual_seed(tracker, seed, tp_rank, ep_rank, etp_rank)
