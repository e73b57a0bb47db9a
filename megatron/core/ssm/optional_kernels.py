"""The ``mamba_ssm`` and ``causal_conv1d`` kernels, used when they are installed and the tensors
are on CUDA (as Megatron uses them), never required: otherwise :mod:`.ssd`'s PyTorch code runs.

* :func:`chunk_scan` -> ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` with
  ``D``, the initial state, ``z=None`` (the gate belongs to the gated RMSNorm after the scan)
  and ``dt`` after its bias and softplus, which the caller computes in float32 (the precision
  the kernel would compute them in with ``dt_bias`` and ``dt_softplus=True``; kept in our code so
  that both paths scan the very same dt).
* :func:`causal_conv1d_silu` -> ``causal_conv1d.causal_conv1d_fn(x, weight [d, k], bias,
  activation="silu")`` on a channel-first contiguous x, as Megatron passes it. It falls back
  when the convolution continues a cached history (generation; the kernel takes initial states
  in the channel-last layout only) or the width is outside the kernel's 2..4.

The single-token decode step of generation always uses :func:`.ssd.ssd_recurrent`.
"""

import functools
import importlib
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from .ssd import causal_depthwise_conv1d, ssd_chunked

# The dtypes both kernels are built for (no float64).
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _optional_function(module: str, name: str) -> Optional[Callable]:
    """``module.name``, or None when the package is not installed (looked up once)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def kernels_apply(t: torch.Tensor) -> bool:
    """Whether a kernel may compute on ``t``: on CUDA and in a dtype the kernels are built for."""
    return t.is_cuda and t.dtype in _KERNEL_DTYPES


def _scan_kernel(x: torch.Tensor) -> Optional[Callable]:
    if not kernels_apply(x):
        return None
    return _optional_function("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")


def _conv_kernel(x: torch.Tensor, width: int, history: Optional[torch.Tensor]):
    if history is not None or not 2 <= width <= 4 or not kernels_apply(x):
        return None
    return _optional_function("causal_conv1d", "causal_conv1d_fn")


def chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`.ssd.ssd_chunked` (same arguments: x [b, l, h, p], dt [b, l, h] positive, A [h],
    B and C [b, l, g, n], D [h], initial_state [b, h, p, n]) -> (y [b, l, h, p], final state
    [b, h, p, n])."""
    kernel = _scan_kernel(x)
    if kernel is None:
        return ssd_chunked(x, dt, A, B, C, chunk_size, D, initial_state=initial_state)
    return kernel(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=D,
        z=None,
        dt_bias=None,
        initial_states=initial_state,
        dt_softplus=False,
        return_final_states=True,
    )


def causal_conv1d_silu(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    history: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """silu of :func:`.ssd.causal_depthwise_conv1d` (same arguments: xbc [b, d, l], weight
    [d, 1, k], bias [d], history [b, d, k-1] or None) -> [b, d, l]."""
    kernel = _conv_kernel(xbc, weight.shape[-1], history)
    if kernel is None:
        return F.silu(causal_depthwise_conv1d(xbc, weight, bias, history=history))
    return kernel(xbc.contiguous(), weight.squeeze(1), bias, activation="silu")
