"""Base module of the model zoo and the fp16/bf16 wrapper (Megatron Core's ``module.py``)."""

from typing import Any

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class MegatronModule(torch.nn.Module):
    """A ``torch.nn.Module`` that keeps its ``TransformerConfig`` as ``self.config``."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """State dict written to checkpoints (the plain state dict here)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def set_is_first_microbatch(self):
        """Hook for layers that cache weights per micro-batch (fp8); nothing to do here."""

    def set_moe_aux_loss_scale(self, scale) -> None:
        """The factor the schedule applies to the coming micro-batch's loss (a float, or a device
        tensor with fp16 loss scaling), for the MoE routers' auxiliary losses; models with MoE
        layers hand it to their routers, other modules have none."""


def _convert_floats(value: Any, source: torch.dtype, convert) -> Any:
    if isinstance(value, torch.Tensor):
        return convert(value) if value.dtype == source else value
    if isinstance(value, (tuple, list)):
        return type(value)(_convert_floats(v, source, convert) for v in value)
    if isinstance(value, dict):
        return {k: _convert_floats(v, source, convert) for k, v in value.items()}
    return value


class Float16Module(MegatronModule):
    """Casts a model to fp16/bf16 and converts its float inputs and outputs.

    Float32 inputs are cast to the half dtype when the wrapped model holds the embedding
    (``pre_process``); half outputs are cast back to fp32 when it holds the output layer
    (``post_process``). The state dict is the wrapped module's, without a ``module.`` prefix:
    Megatron's Float16Module also returns its module's state dict, so checkpoints match.
    """

    def __init__(self, config: TransformerConfig, module: torch.nn.Module):
        super().__init__(config)
        if config.fp16:
            self.half_dtype = torch.float16
        elif config.bf16:
            self.half_dtype = torch.bfloat16
        else:
            raise ValueError("Float16Module needs config.fp16 or config.bf16 (--fp16 / --bf16)")
        self.add_module("module", module.to(self.half_dtype))

    def set_input_tensor(self, input_tensor):
        return self.module.set_input_tensor(input_tensor)

    def set_moe_aux_loss_scale(self, scale) -> None:
        self.module.set_moe_aux_loss_scale(scale)

    def forward(self, *inputs, **kwargs):
        half = self.half_dtype
        if getattr(self.module, "pre_process", True):
            inputs = _convert_floats(inputs, torch.float32, lambda t: t.to(half))
            kwargs = _convert_floats(kwargs, torch.float32, lambda t: t.to(half))
        outputs = self.module(*inputs, **kwargs)
        if getattr(self.module, "post_process", True):
            outputs = _convert_floats(outputs, half, lambda t: t.float())
        return outputs

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        return self.module.sharded_state_dict(prefix, sharded_offsets, metadata)
