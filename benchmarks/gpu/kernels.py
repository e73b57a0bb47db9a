"""Kernel time by family, from a torch.profiler run: which share of the GPU's time goes to matrix
products, attention, elementwise work, the optimizer, communication and copies.

``family(name)`` classifies one kernel name as the CUDA profiler (CUPTI) reports it (cuBLAS's
``sm90_xmma_gemm_*``/``nvjet_*``/``ampere_*gemm*``, FlashAttention / memory-efficient attention,
PyTorch's ``vectorized_elementwise_kernel<...>``, ``multi_tensor_apply_kernel``, NCCL,
``Memcpy HtoD``...), or, in the CPU smoke mode, an ATen operator name (``aten::addmm``...). The
rules are tried in order; the first that matches wins, and a name no rule matches is ``other``
(reported, never dropped). ``summarize(profiler_rows(profiler, device))`` sums the device time
of every kernel (CUDA) or the self CPU time of every operator (CPU) by family.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Tuple

FAMILIES = (
    "matrix products",
    "attention",
    "elementwise",
    "optimizer",
    "communication",
    "copies",
    "other",
)

# (family, pattern) in the order they are tried; matched case-insensitively anywhere in the name.
_RULES: List[Tuple[str, re.Pattern]] = [
    (family, re.compile(pattern, re.IGNORECASE))
    for family, pattern in (
        # Collectives first: NCCL's kernels carry reduction and dtype words in their names.
        ("communication", r"nccl|c10d|gloo|record_param_comms"),
        # Multi-tensor kernels (fused/foreach AdamW, the foreach grad norm and copies) and the
        # per-tensor optimizer's ops.
        ("optimizer", r"multi_tensor_apply|adam|_foreach_|l2norm|lpnorm"),
        # Attention before matrix products: FlashAttention's names contain sm80/sm90 too.
        ("attention", r"flash|fmha|attention|sdpa"),
        (
            "matrix products",
            r"gemm|cutlass|xmma|nvjet|cublas|wgmma|matmul|triton_tem|splitk|dot_kernel"
            r"|aten::(add|b|baddb|addb)?mm\b|aten::linear\b",
        ),
        # Copies and casts (direct_copy_kernel is PyTorch's copy_/to() kernel, fp32 <-> bf16).
        ("copies", r"memcpy|memset|direct_copy|copy_kernel|aten::copy_|aten::_?to_copy|catarray"),
        (
            "elementwise",
            r"elementwise|reduce_kernel|reduction|norm|softmax|triton|gelu|dropout|index|"
            r"gather|scatter|fill|cross_entropy|unrolled|distribution|where|at::native::|aten::",
        ),
    )
]


def family(name: str) -> str:
    """The family of one kernel (or ATen operator) name."""
    for fam, pattern in _RULES:
        if pattern.search(name):
            return fam
    return "other"


def summarize(rows: Iterable[Tuple[str, float]]) -> Dict[str, float]:
    """{family: microseconds} over (name, microseconds) rows; every family present (0 if none)."""
    totals = {fam: 0.0 for fam in FAMILIES}
    for name, microseconds in rows:
        totals[family(name)] += microseconds
    return totals


def profiler_rows(profiler, device: str) -> List[Tuple[str, float]]:
    """(name, self microseconds) of the profiler's key_averages(): on CUDA the rows of the device
    itself (kernels, memcpy, memset) and their device time; an operator's row also carries the
    time of the kernels it launched, so it is left out, or every kernel would count twice. On
    CPU the operators' self CPU time."""
    from torch.autograd import DeviceType

    rows = []
    for event in profiler.key_averages():
        if device == "cuda":
            if event.device_type == DeviceType.CPU:
                continue
            value = getattr(event, "self_device_time_total", None)
            if value is None:  # torch before 2.4
                value = getattr(event, "self_cuda_time_total", 0.0)
        else:
            value = event.self_cpu_time_total
        if value:
            rows.append((event.key, float(value)))
    return rows


def top_unclassified(rows: Iterable[Tuple[str, float]], count: int = 5) -> List[Tuple[str, float]]:
    """The largest rows classified ``other``, to refine the rules from a real run."""
    others = [(name, us) for name, us in rows if family(name) == "other"]
    return sorted(others, key=lambda row: -row[1])[:count]
