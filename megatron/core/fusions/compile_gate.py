"""When the fusions run their torch.compile'd functions: on CUDA where Triton works (inductor's
code generator for GPUs), and not inside a region that torch.compile is already tracing (there
the compiler fuses the plain chain itself). ``TORCH_COMPILE_DISABLE=1`` (torch's own switch)
runs the compiled functions eagerly."""

import functools

import torch


@functools.cache
def _triton_works() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def compiles(x: torch.Tensor) -> bool:
    """Whether a fusion given ``x`` runs its compiled function."""
    return x.device.type == "cuda" and not torch.compiler.is_compiling() and _triton_works()
