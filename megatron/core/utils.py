"""Helpers shared across megatron.core: reaching the model inside its wrappers."""

from typing import List, Union

import torch


def unwrap_model(
    model: Union[torch.nn.Module, List[torch.nn.Module]],
) -> Union[torch.nn.Module, List[torch.nn.Module]]:
    """The model inside its wrappers (a list of model chunks gives the list of inner models).

    DistributedDataParallel, TorchFullyShardedDataParallel and Float16Module each keep the module
    they wrap as ``.module``; they nest (DDP around Float16Module around the model), so the
    wrappers are peeled off until a module without an inner ``.module`` remains.
    """
    if isinstance(model, (list, tuple)):
        return [unwrap_model(chunk) for chunk in model]
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def get_model_config(model: torch.nn.Module):
    """The config (TransformerConfig) of a possibly wrapped model chunk.

    Wrappers have configs of their own (DDP's is its DistributedDataParallelConfig), so the
    config is read from the innermost model.
    """
    inner = unwrap_model(model)
    config = getattr(inner, "config", None)
    if config is None:
        raise ValueError(f"model {type(inner).__name__} has no config attribute")
    return config


class NonFiniteValueError(RuntimeError):
    """A loss or a gradient became NaN or Inf with the NaN check on: the run stops there, with a
    line that says where, instead of training on garbage."""
