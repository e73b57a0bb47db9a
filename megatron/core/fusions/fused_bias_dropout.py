"""Bias + dropout + residual add (Megatron's ``--bias-dropout-fusion``): the end of every block
of a transformer layer,

    out = residual + dropout(x + bias, p)

Unfused this is up to three element-wise passes over the activation (our linear layers add
their bias inside the matrix product, so ``bias`` is None unless a layer is built with
``skip_bias_add``: then dropout and the residual add are two). Fused (``fused=True``) on CUDA it
is one ``torch.compile``'d function: the dropout mask is drawn first,
in eager mode, by ``bernoulli_`` from the device's current generator (so the RNG tracker's
forked stream that the caller has entered decides it, as it decides the unfused ``F.dropout``),
and the add, the masking and the residual add are one generated kernel forward and one
backward. The mask is a bool tensor (one byte per element, what aten's fused dropout keeps too).

The fused CUDA path draws its mask with ``bernoulli_`` instead of aten's fused dropout kernel,
so its masks differ from the unfused path's on CUDA (both are dropout with probability p from
the same generator, and every TP/PP layout draws them alike). On CPU aten's ``F.dropout`` is
itself ``bernoulli_`` on a tensor of the input's shape: the fused function, compiled on CPU in
the tests, draws the same mask from the same generator state.

Elsewhere (CPU: the default path there is never compiled and keeps its numerics) and inside a
region that torch.compile is already tracing (``--compile-transformer-layers``: the compiler
fuses the plain chain itself), the plain chain runs whatever ``fused`` says.
"""

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.fusions.compile_gate import compiles


def _bias_dropout_add_plain(
    x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    if training and p > 0.0:
        x = F.dropout(x, p=p, training=True)
    return residual + x


def _bias_mask_add(
    x: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: torch.Tensor,
    keep: Optional[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """residual + (x + bias) * keep * scale; what torch.compile fuses (``keep`` None: no
    dropout)."""
    if bias is not None:
        x = x + bias
    if keep is not None:
        x = x * keep * scale
    return residual + x


@functools.cache
def _compiled_bias_mask_add():
    # Built on first use, so that importing the library (and every CPU run) never touches the
    # compiler. One compiled graph per input shape/dtype; a second shape recompiles it with
    # dynamic sizes (torch.compile's default).
    return torch.compile(_bias_mask_add)


_compiles = compiles  # a name of this module, so that tests can route CPU tensors through it


def bias_dropout_add(
    x: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: torch.Tensor,
    p: float,
    training: bool,
    fused: bool,
) -> torch.Tensor:
    """residual + dropout(x + bias, p) (dropout only when ``training``); ``bias`` [h] or None is
    broadcast over x [..., h]. ``fused``: one compiled kernel on CUDA (see the module's doc).
    Dropout draws from the current generator of x's device: enter the RNG tracker's fork
    around the call where the activations are split across TP ranks."""
    if not (fused and _compiles(x)):
        return _bias_dropout_add_plain(x, bias, residual, p, training)
    keep = None
    scale = 1.0
    if training and p > 0.0:
        keep = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - p)
        scale = 1.0 / (1.0 - p)
    return _compiled_bias_mask_add()(x, bias, residual, keep, scale)
