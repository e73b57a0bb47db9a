"""Fused operations (Megatron's ``megatron/core/fusions``): autograd Functions that are faster
than the chain of aten ops they replace on CPUs, and torch.compile'd functions on CUDA; same
math as the unfused path."""

from .fused_bias_dropout import bias_dropout_add
from .fused_bias_gelu import bias_gelu_tanh, gelu_tanh
from .fused_linear_cross_entropy import linear_cross_entropy

__all__ = ["bias_dropout_add", "bias_gelu_tanh", "gelu_tanh", "linear_cross_entropy"]
