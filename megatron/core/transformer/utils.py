"""Small helpers of the transformer: weight init methods and activation functions."""

import math
from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.random import checkpoint, current_rng_tracker


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Init method drawing from N(0, sigma) (Megatron's default for every weight matrix)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    init_.std = sigma  # lets tests and tools see which std a method draws with
    return init_


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """Init method drawing from N(0, sigma / sqrt(multiplier * num_layers)).

    Used for the projections that write into the residual stream (attention ``linear_proj`` and
    MLP ``linear_fc2``) so the residual's variance does not grow with depth (GPT-2 scheme).
    """
    return init_method_normal(sigma / math.sqrt(multiplier * num_layers))


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU's tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (``--openai-gelu``,
    the GeLU of OpenAI's GPT-2)."""
    return F.gelu(x, approximate="tanh")


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (``--squared-relu``, Primer)."""
    return torch.pow(F.relu(x), 2)


# Keys of the initialization scopes that are not transformer layers (layers use their number).
EMBEDDING_INIT_KEY = 0
OUTPUT_LAYER_INIT_KEY = 1 << 20


@contextmanager
def init_rng_scope(init_seed: Optional[int], key: int):
    """Build the parameters created inside from a CPU generator seeded by (``init_seed``, ``key``).

    With ``init_seed`` None this does nothing (weights come from the global generator in build
    order). Otherwise the global CPU RNG state is saved and restored around the block, so the
    dropout stream seen by training is the same as without it.
    """
    if init_seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((int(init_seed) * 1_000_003 + key) % (1 << 62))
        yield


def recompute(config, function, *args, tp_group=None, distribute_saved_activations: bool = False):
    """``function(*args)`` with its activations recomputed in backward (activation recompute).

    The recomputation replays the CPU/device generators and every stream of the config's tracker
    (:func:`rng_tracker_of`), so dropout masks, also those drawn on tensor-parallel-split
    activations, equal the first run's. ``distribute_saved_activations`` keeps 1/TP of ``args[0]``
    per ``tp_group`` rank.
    """
    return checkpoint(
        function,
        distribute_saved_activations,
        *args,
        rng_tracker=rng_tracker_of(config),
        tp_group=tp_group,
    )


def selectively_recomputed(config, module: str) -> bool:
    """Whether selective recompute (``--recompute-granularity selective``) checkpoints
    ``module`` (one of ``--recompute-modules``; megatron-core's default list is core_attn)."""
    if config.recompute_granularity != "selective":
        return False
    modules = config.recompute_modules if config.recompute_modules is not None else ["core_attn"]
    return module in modules


def rng_tracker_of(config):
    """The RNG tracker the layers of ``config`` draw model-parallel dropout from:
    ``config.rng_tracker`` when set, else the current one that ``model_parallel_cuda_manual_seed``
    made (megatron-core's layers read ``get_cuda_rng_tracker()``), else None."""
    tracker = getattr(config, "rng_tracker", None)
    return tracker if tracker is not None else current_rng_tracker()


def model_parallel_rng(config, split_across_tp: bool):
    """Context for dropout on activations split across TP ranks: the tracker's model-parallel
    stream (different per TP rank), or nothing when the activations are replicated."""
    tracker = rng_tracker_of(config)
    if tracker is None or not split_across_tp or config.tensor_model_parallel_size == 1:
        return _null_context()
    return tracker.fork()


@contextmanager
def _null_context():
    yield
