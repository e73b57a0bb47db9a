"""LayerNorm and RMSNorm over the last dimension, with Megatron's zero-centred gamma option.

With ``layernorm_zero_centered_gamma`` (``--apply-layernorm-1p``) the weight is stored centred
on zero (initialized to 0) and the norm scales by (1 + weight), which keeps weight decay from
pulling the scale towards zero. RMSNorm has no bias.

When the input dtype differs from the parameters' (fp32 residual stream with half parameters)
the norm is computed in fp32 and returned in the parameter dtype, as Megatron's mixed fused
LayerNorm does, so the following GEMM runs in the parameter dtype.
"""

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.parameters import new_constant_param


class _Norm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float):
        super().__init__()
        self.hidden_size = hidden_size
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.weight = new_constant_param(
            (hidden_size,), config, 0.0 if self.zero_centered_gamma else 1.0
        )
        # Under sequence parallelism the norm's grads are partial per TP rank and need an
        # all-reduce.
        self.weight.sequence_parallel = config.sequence_parallel

    def _gamma(self, dtype: torch.dtype) -> torch.Tensor:
        weight = self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        return weight + 1 if self.zero_centered_gamma else weight

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last dimension."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(config, hidden_size, eps)
        self.bias = new_constant_param((hidden_size,), config, 0.0)
        self.bias.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        param_dtype = self.weight.dtype
        if x.dtype == param_dtype:
            return F.layer_norm(
                x, self.normalized_shape, self._gamma(param_dtype), self.bias, self.eps
            )
        bias = self.bias.float()
        out = F.layer_norm(
            x.float(), self.normalized_shape, self._gamma(torch.float32), bias, self.eps
        )
        return out.to(param_dtype)


class RMSNorm(_Norm):
    """x / sqrt(mean(x^2) + eps) * gamma over the last dimension (no bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        param_dtype = self.weight.dtype
        if x.dtype == param_dtype:
            return F.rms_norm(x, self.normalized_shape, self._gamma(param_dtype), self.eps)
        out = F.rms_norm(x.float(), self.normalized_shape, self._gamma(torch.float32), self.eps)
        return out.to(param_dtype)


def build_norm(config, hidden_size: int, eps: float = None) -> _Norm:
    """The norm selected by ``config.normalization`` ('LayerNorm' or 'RMSNorm')."""
    if eps is None:
        eps = config.layernorm_epsilon
    if config.normalization == "LayerNorm":
        return LayerNorm(config, hidden_size, eps)
    if config.normalization == "RMSNorm":
        return RMSNorm(config, hidden_size, eps)
    raise ValueError(f"unknown normalization {config.normalization!r} (--normalization)")
