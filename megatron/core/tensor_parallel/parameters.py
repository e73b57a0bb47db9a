"""Creating parameters: where they live, how they are initialized, and the tensor-parallel
attributes every parameter carries (read by optimizer and checkpoint code)."""

from typing import Callable

import torch


def param_device(config) -> torch.device:
    """Device new parameters are created on: meta with ``init_model_with_meta_device``, else CPU.

    Weights are initialized on the CPU with the default CPU generator so that a seed gives the
    same model on every device; the caller moves the model to its accelerator afterwards.
    """
    return torch.device("meta") if config.init_model_with_meta_device else torch.device("cpu")


def set_default_tensor_parallel_attributes(param: torch.Tensor) -> None:
    """Mark a parameter as not split across tensor-parallel ranks.

    Every parameter carries ``tensor_model_parallel``/``partition_dim``/``partition_stride`` so that
    optimizer and checkpoint code can read them without ``getattr`` defaults. At TP=1 nothing is
    split, so all parameters get False / -1 / 1 (Megatron's values for unsplit parameters).
    """
    param.tensor_model_parallel = False
    param.partition_dim = -1
    param.partition_stride = 1


def new_weight(shape, config, init_method: Callable) -> torch.nn.Parameter:
    """A weight in ``config.params_dtype`` initialized by ``init_method`` (unless disabled).

    Half-precision weights are drawn in fp32 and rounded, so fp32 and bf16/fp16 models built from
    the same seed hold the same values up to rounding.
    """
    device = param_device(config)
    weight = torch.empty(shape, dtype=config.params_dtype, device=device)
    if config.perform_initialization and device.type != "meta":
        with torch.no_grad():
            if weight.dtype in (torch.float32, torch.float64):
                init_method(weight)
            else:
                master = torch.empty(shape, dtype=torch.float32, device=device)
                init_method(master)
                weight.copy_(master)
    param = torch.nn.Parameter(weight)
    set_default_tensor_parallel_attributes(param)
    return param


def new_constant_param(shape, config, value: float) -> torch.nn.Parameter:
    """A parameter filled with ``value`` (biases: 0, norm weights: 1, or 0 with zero-centred
    gamma)."""
    device = param_device(config)
    tensor = torch.empty(shape, dtype=config.params_dtype, device=device)
    if device.type != "meta":
        tensor.fill_(value)
    param = torch.nn.Parameter(tensor)
    set_default_tensor_parallel_attributes(param)
    return param
