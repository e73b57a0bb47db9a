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
from typing import Dict, Iterable, List, Sequence, Tuple

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


def profiler_kernels(profiler, device: str) -> List[Tuple[str, float, int]]:
    """(name, self microseconds, calls) of the profiler's key_averages(): on CUDA the rows of the
    device itself (kernels, memcpy, memset) and their device time; an operator's row also carries
    the time of the kernels it launched, so it is left out, or every kernel would count twice. On
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
            rows.append((event.key, float(value), int(event.count)))
    return rows


def profiler_rows(profiler, device: str) -> List[Tuple[str, float]]:
    """(name, self microseconds) of :func:`profiler_kernels`."""
    return [(name, us) for name, us, _ in profiler_kernels(profiler, device)]


# Families whose kernels are listed one by one: the time outside the matrix products and
# attention, where a fused or removed kernel can still be won.
LISTED_FAMILIES = ("elementwise", "copies", "optimizer")


def short_name(name: str, width: int = 120) -> str:
    """A kernel name a table can hold: no ``void``, namespaces, ``operator()`` chains or the
    kernel's own parameter list; what is left (the kernel and its functor, e.g.
    ``vectorized_elementwise_kernel<4, GeluCUDAKernelImpl[BFloat16], Array<char*, 2> >``)
    cut to ``width`` characters."""
    text = re.sub(r"^void ", "", name.strip())
    if not text.startswith("aten::"):  # the CPU mode's operator names are short already
        text = text.replace("(anonymous namespace)::", "").replace("::operator()() const", "")
        text = re.sub(r"(?:::)?\{lambda\(\)#\d+\}", "", text)  # the no-argument lambdas
        text = re.sub(r"(?:::)?\{lambda\(([^()]*)\)#\d+\}", r"[\1]", text)  # [dtype] kept
        text = re.sub(r"\b(?:[A-Za-z_]\w*::)+(?=[A-Za-z_~])", "", text)
        text = re.sub(r"\(TensorIteratorBase&[^()]*\)", "", text)  # a functor's parameters
    if text.endswith(")") and "<" in text:  # a template kernel: drop its parameter list
        depth = 0
        for i in range(len(text) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(text[i], 0)
            if depth == 0:
                text = text[:i].rstrip()
                break
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= width else text[: width - 3] + "..."


def top_kernels(
    kernels: Iterable[Tuple[str, float, int]],
    iterations: int,
    families: Sequence[str] = LISTED_FAMILIES,
    count: int = 8,
) -> Dict[str, List[dict]]:
    """{family: the ``count`` kernels with the most time, largest first}, each as ``name`` (short),
    ``ms_per_iteration`` and ``calls_per_iteration`` over ``iterations`` profiled iterations."""
    listed: Dict[str, List[Tuple[str, float, int]]] = {fam: [] for fam in families}
    for name, microseconds, calls in kernels:
        fam = family(name)
        if fam in listed:
            listed[fam].append((name, microseconds, calls))
    return {
        fam: [
            {
                "name": short_name(name),
                "ms_per_iteration": microseconds / 1000.0 / iterations,
                "calls_per_iteration": calls / iterations,
            }
            for name, microseconds, calls in sorted(rows, key=lambda row: -row[1])[:count]
        ]
        for fam, rows in listed.items()
    }


def top_kernel_lines(top: Dict[str, List[dict]]) -> List[str]:
    """The table lines of :func:`top_kernels`."""
    lines = []
    for fam in [fam for fam in LISTED_FAMILIES if fam in top] + [
        f for f in top if f not in LISTED_FAMILIES
    ]:
        rows = top[fam]
        lines.append(f"  top {fam} kernels (ms per iteration, calls per iteration):")
        lines.extend(
            f"    {row['ms_per_iteration']:>8.2f} ms {row['calls_per_iteration']:>7.1f}x  "
            f"{row['name']}"
            for row in rows
        )
    return lines


def top_unclassified(rows: Iterable[Tuple[str, float]], count: int = 5) -> List[Tuple[str, float]]:
    """The largest rows classified ``other``, to refine the rules from a real run."""
    others = [(name, us) for name, us in rows if family(name) == "other"]
    return sorted(others, key=lambda row: -row[1])[:count]
