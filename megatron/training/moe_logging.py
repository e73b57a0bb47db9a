"""The MoE routers' auxiliary losses in the log line and TensorBoard (Megatron's names:
``load_balancing_loss``, ``seq_load_balancing_loss``, ``global_load_balancing_loss``,
``z_loss``).

Each router sums its losses (without their coefficients) over the micro-batches of a step, for
the tokens of its rank. Per layer they are summed over the ranks that split a sequence (TP x
CP), averaged over data parallelism (the global-batch loss, whose parts add up over DP too, is
summed) and divided by the micro-batches; the logged value is the mean over the MoE layers of
the model. With ``--moe-per-layer-logging`` each layer's value also
goes to TensorBoard as ``moe/<name>_layer_<n>``.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron.core.tensor_parallel import collectives as C
from megatron.core.transformer.moe.moe_config import is_moe_layer
from megatron.core.transformer.moe.router import LOSS_NAMES
from megatron.core.utils import get_model_config, unwrap_model

_SUMMED_OVER_DP = ("global_load_balancing_loss",)
"""Losses whose per-rank parts add up over data parallelism as well."""


def tracked_loss_names(config) -> List[str]:
    """The losses the routers of ``config`` record, in the order they are logged."""
    if not getattr(config, "num_moe_experts", None):
        return []
    types = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    types = types if isinstance(types, (list, tuple)) else [types]
    coeffs = coeffs if isinstance(coeffs, (list, tuple)) else [coeffs]
    names = [LOSS_NAMES[t] for t, c in zip(types, coeffs) if LOSS_NAMES.get(t) and c]
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def collect_moe_losses(model, state, num_microbatches: int) -> Dict[str, torch.Tensor]:
    """name -> per-layer values [num_layers] of this step (every rank must call it: it
    reduces across ranks), and the routers' sums cleared."""
    config = get_model_config(model[0])
    names = tracked_loss_names(config)
    if not names:
        return {}
    # Each chunk holds its own layers and reports 0 for the others.
    values = sum(unwrap_model(chunk).moe_metrics(names, config.num_layers) for chunk in model)
    for chunk in model:
        unwrap_model(chunk).reset_moe_metrics()
    if state is not None:
        C.all_reduce(values, state.get_pipeline_model_parallel_group())
        C.all_reduce(values, state.group("tp-cp"))
        dp = state.get_data_parallel_group()
        values = C.all_reduce(values, dp)
        for i, name in enumerate(names):
            if name not in _SUMMED_OVER_DP:
                values[i] /= C.group_size(dp)
    values = values / num_microbatches
    return {name: values[i] for i, name in enumerate(names)}


def moe_loss_scalars(per_layer: Dict[str, torch.Tensor], config) -> Dict[str, torch.Tensor]:
    """name -> mean over the MoE layers (the log line's values), a 0-d tensor on the device:
    training_log reads it on the host only when it prints or writes it."""
    moe_layers = [i for i in range(config.num_layers) if is_moe_layer(config, i)]
    depths = getattr(config, "mtp_num_layers", None) or 0
    if depths and is_moe_layer(config, config.num_layers - 1):
        # MTP depths are MoE layers like the model's last: Megatron averages over them too.
        moe_layers += [config.num_layers + k for k in range(depths)]
    if not moe_layers or not per_layer:  # no balancing loss nor z-loss is tracked
        return {}
    # Basic indexing: a tensor of indices would be a host-to-device copy, which waits.
    return {name: torch.stack([v[i] for i in moe_layers]).mean() for name, v in per_layer.items()}


def write_per_layer(writer, per_layer: Dict[str, torch.Tensor], config, iteration: int) -> None:
    """``moe/<name>_layer_<n>`` for every MoE layer (n is 1-based)."""
    for name, values in per_layer.items():
        for i in range(config.num_layers):
            if is_moe_layer(config, i):
                writer.add_scalar(f"moe/{name}_layer_{i + 1}", values[i].item(), iteration)
