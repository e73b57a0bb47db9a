"""Bias + tanh-approximation GELU (Megatron's ``--bias-gelu-fusion``), fast on CPUs.

    gelu(x) = 0.5 x (1 + tanh(z)),  z = sqrt(2/pi) (x + 0.044715 x^3)

is computed as x * sigmoid(2z) (0.5 (1 + tanh(z)) == sigmoid(2z)): aten's CPU kernel for
``F.gelu(approximate='tanh')`` evaluates tanh, which is several times slower than the exp
behind sigmoid on AVX2 CPUs, and its backward is slower still. Here the forward is four
element-wise passes and the backward five, with a hand-written derivative; about twice as
fast as aten's forward + backward on one core. The cost is memory: sigmoid(2z) is saved for
backward next to the input (one extra activation of the MLP's width).

On CUDA the bias add and the GELU are one ``torch.compile``'d function (one generated kernel
forward, one backward; half-precision inputs are computed in fp32 and rounded once, as aten's
kernel does). On other devices, for half-precision inputs on CPU (a chain of bf16 passes would
round at every step) and inside a region that torch.compile is already tracing, the aten chain
is used: the result is the same function every way.

On CPU the bias is added in eager mode before the hand-written function (its gradient is then
autograd's broadcast reduction, the one the unfused MLP has).
"""

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.fusions.compile_gate import compiles

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715


class GeLUTanhFunction(torch.autograd.Function):
    """gelu_tanh(x) with the derivative written out:

    d/dx [x s] = s + x s (1 - s) 2c (1 + 3a x^2),   s = sigmoid(2z).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        two_c = torch.tensor(2.0 * _C, dtype=x.dtype, device=x.device)
        # s = sigmoid(2c (x + a x^3)) = sigmoid(x (2c + 2ca x^2)), computed in one new tensor.
        s = torch.addcmul(two_c, x, x, value=2.0 * _C * _A).mul_(x).sigmoid_()
        if not ctx.needs_input_grad[0]:
            return s.mul_(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, s = ctx.saved_tensors
        two_c = torch.tensor(2.0 * _C, dtype=x.dtype, device=x.device)
        grad = torch.addcmul(two_c, x, x, value=6.0 * _C * _A).mul_(x)  # 2c (1 + 3a x^2) x
        grad.mul_(torch.addcmul(s, s, s, value=-1.0))  # * s (1 - s)
        return grad.add_(s).mul_(grad_output)


def _bias_gelu_tanh_chain(input_: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    x = input_ if bias is None else input_ + bias
    return F.gelu(x, approximate="tanh")


@functools.cache
def _compiled_bias_gelu_tanh():
    # Built on first use, so that importing the library (and every CPU run) never touches the
    # compiler. One compiled graph per input shape/dtype; a second shape recompiles it with
    # dynamic sizes (torch.compile's default).
    return torch.compile(_bias_gelu_tanh_chain)


_compiles = compiles  # a name of this module, so that tests can route CPU tensors through it


def _hand_written(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.float64)
        and not torch.compiler.is_compiling()
    )


def bias_gelu_tanh(input_: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """gelu(input + bias) with the tanh approximation; ``bias`` [h] broadcast over input
    [..., h]."""
    if _compiles(input_):
        return _compiled_bias_gelu_tanh()(input_, bias)
    if _hand_written(input_) and (bias is None or bias.dtype == input_.dtype):
        x = input_ if bias is None else input_ + bias
        return GeLUTanhFunction.apply(x)
    return _bias_gelu_tanh_chain(input_, bias)


def gelu_tanh(input_: torch.Tensor) -> torch.Tensor:
    """The tanh-approximation GELU (GPT-2's ``gelu_new``); see :func:`bias_gelu_tanh`."""
    return bias_gelu_tanh(input_, None)
