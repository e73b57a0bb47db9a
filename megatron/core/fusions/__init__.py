"""Fused operations (Megatron's ``megatron/core/fusions``), written as autograd Functions that
are faster than the chain of aten ops they replace on CPUs; same math as the unfused path."""

from .fused_bias_gelu import bias_gelu_tanh, gelu_tanh
from .fused_linear_cross_entropy import linear_cross_entropy

__all__ = ["bias_gelu_tanh", "gelu_tanh", "linear_cross_entropy"]
