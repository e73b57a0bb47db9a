"""Muon (``--optimizer muon``): momentum orthogonalized by a Newton-Schulz iteration for the 2-D
weight matrices, Adam (or Lion) for every other parameter, as Megatron defines it.

One step of a Muon parameter W with gradient G (Megatron / NVIDIA Emerging-Optimizers):

* decoupled weight decay: W <- W * (1 - lr * wd);
* momentum as an exponential average: M <- beta * M + (1 - beta) * G (``--muon-momentum``);
  the update direction is M, or (1 - beta) * G + beta * M with ``--muon-nesterov``;
* orthogonalization: the direction is divided by its Frobenius norm and pushed towards its
  polar factor U V^T by ``--muon-num-ns-steps`` Newton-Schulz steps X <- a X + (b A + c A^2) X,
  A = X X^T, on the wide orientation of the matrix, with the (a, b, c) of
  ``--muon-coefficient-type``; with ``--muon-fp32-matmul-prec medium`` the steps run in bf16;
* scaling by ``--muon-scale-mode`` (spectral sqrt(max(out, in)), unit_rms_norm sqrt(out / in),
  shape_scaling sqrt(max(1, out / in))) times ``--muon-extra-scale-factor``, computed from the
  full (unsplit) matrix shape;
* W <- W - lr * update.

The fused QKV weight is orthogonalized as its Q, K and V parts (``--muon-no-split-qkv``: as one
matrix). The embedding, the output layer and 1-D parameters take ``--muon-scalar-optimizer``:
AdamW (``--adam-beta1/2``, ``--adam-eps``; the same update as torch.optim.AdamW) or Lion
(``--lion-beta1/2``).

Tensor parallelism (``--muon-tp-mode``) for a weight split over the TP group along its
``partition_dim``: 'duplicated' all-gathers the shards, orthogonalizes the full matrix on every
rank and keeps this rank's part; 'distributed' iterates on the shards, oriented so that the
split dimension is summed over in X X^T, which is all-reduced (as is the Frobenius norm);
'blockwise' orthogonalizes each shard on its own (a different update: its scale uses the shard's
shape). Newton-Schulz commutes with permuting rows or columns, so the interleaved shards of a
strided weight (SwiGLU's fc1) give the same result as the unsplit matrix.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import collectives

# (a, b, c) of X <- a X + (b A + c A^2) X, A = X X^T. Published coefficient sets: Keller Jordan's
# Muon ('simple'), the per-step tuned quintic of modded-nanogpt ('quintic'), Polar Express
# (arXiv:2505.16932) and the AOL set of flash-newton-schulz ('aol').
COEFFICIENT_SETS: Dict[str, List[Tuple[float, float, float]]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
}
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("blockwise", "duplicated", "distributed")
MATMUL_PRECISIONS = ("medium", "high")
_NORM_EPS = 1e-7


def newton_schulz_coefficients(coefficient_type: str, steps: int) -> List[Tuple[float, ...]]:
    """The (a, b, c) of each of ``steps`` iterations: 'simple' repeats its one set,
    'polar_express' repeats its last set past its eight, the others cycle and need a multiple of
    their length."""
    if coefficient_type not in COEFFICIENT_SETS:
        raise ValueError(
            f"--muon-coefficient-type {coefficient_type!r} unknown (choose from "
            f"{', '.join(COEFFICIENT_SETS)})"
        )
    if steps < 1:
        raise ValueError(f"--muon-num-ns-steps must be >= 1, got {steps}")
    sets = COEFFICIENT_SETS[coefficient_type]
    if coefficient_type == "simple":
        return sets * steps
    if coefficient_type == "polar_express":
        if steps < len(sets):
            raise ValueError(
                f"--muon-coefficient-type polar_express needs --muon-num-ns-steps >= {len(sets)}, "
                f"got {steps}"
            )
        return sets + [sets[-1]] * (steps - len(sets))
    if steps % len(sets) != 0:
        raise ValueError(
            f"--muon-coefficient-type {coefficient_type} needs --muon-num-ns-steps a multiple of "
            f"{len(sets)}, got {steps}"
        )
    return sets * (steps // len(sets))


@contextmanager
def fp32_matmul_precision(precision: str):
    """torch's float32 matmul precision ('high': TF32 allowed on GPUs) for the block."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def newton_schulz(
    x: torch.Tensor,
    coefficients: Sequence[Tuple[float, ...]],
    matmul_precision: str = "high",
    transpose: Optional[bool] = None,
    tp_group=None,
) -> torch.Tensor:
    """Approximate polar factor of the fp32 matrix ``x``.

    ``transpose`` (default: when x has more rows than columns) iterates on x^T so that A = X X^T
    is the smaller Gram matrix. With ``tp_group`` x is this rank's shard along the dimension that
    X X^T sums over (the columns of X): the squared norm and A are all-reduced over the group.
    ``matmul_precision`` 'medium' runs the iterations in bf16.
    """
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"Newton-Schulz needs an fp32 matrix, got {x.dtype} {tuple(x.shape)}")
    if transpose is None:
        transpose = x.shape[0] > x.shape[1]
    X = x.t() if transpose else x
    squared_norm = X.square().sum()
    if tp_group is not None:
        dist.all_reduce(squared_norm, group=tp_group)
    X = X / squared_norm.sqrt().clamp_min(_NORM_EPS)
    if matmul_precision == "medium":
        X = X.to(torch.bfloat16)
    for a, b, c in coefficients:
        A = X @ X.t()
        if tp_group is not None:
            dist.all_reduce(A, group=tp_group)
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a, alpha=1.0)
    X = X.float()
    return X.t() if transpose else X


def muon_scale_factor(size_out: int, size_in: int, mode: str) -> float:
    """Scale of the orthogonalized update of a [size_out, size_in] matrix."""
    if mode == "spectral":
        return math.sqrt(max(size_out, size_in))
    if mode == "unit_rms_norm":
        return math.sqrt(size_out / size_in)
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, size_out / size_in))
    raise ValueError(f"--muon-scale-mode {mode!r} unknown (choose from {', '.join(SCALE_MODES)})")


def uses_muon(param: torch.Tensor) -> bool:
    """Megatron's split: 2-D weights other than the embedding and output layer take Muon."""
    return param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


class Muon(torch.optim.Optimizer):
    """Muon for the groups whose 'optimizer' is 'muon', AdamW or Lion for the others.

    Group keys: 'lr', 'weight_decay' (set by the scheduler), 'optimizer' ('muon', 'adam' or
    'lion'), and optionally 'eps' (Adam). ``qkv_split`` is (query rows, key rows, value rows) of
    one query group of the fused QKV weight, for parameters marked ``is_qkv``; None orthogonalizes
    them whole. ``tp_group``: the tensor-parallel group of the split weights.
    """

    def __init__(
        self,
        param_groups: List[Dict],
        momentum: float = 0.9,
        nesterov: bool = False,
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        matmul_precision: str = "medium",
        tp_mode: str = "duplicated",
        tp_group=None,
        qkv_split: Optional[Tuple[int, int, int]] = None,
        adam_betas: Tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        lion_betas: Tuple[float, float] = (0.95, 0.98),
    ):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"--muon-momentum must be in [0, 1), got {momentum}")
        if tp_mode not in TP_MODES:
            raise ValueError(f"--muon-tp-mode {tp_mode!r} unknown ({', '.join(TP_MODES)})")
        if matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(
                f"--muon-fp32-matmul-prec {matmul_precision!r} is not available here "
                f"(choose from {', '.join(MATMUL_PRECISIONS)})"
            )
        muon_scale_factor(1, 1, scale_mode)  # validates the mode
        self.coefficients = newton_schulz_coefficients(coefficient_type, num_ns_steps)
        self.scale_mode = scale_mode
        self.extra_scale_factor = extra_scale_factor
        self.matmul_precision = matmul_precision
        self.tp_mode = tp_mode
        self.tp_group = tp_group
        self.tp_size = collectives.group_size(tp_group)
        self.qkv_split = qkv_split
        defaults = dict(
            lr=1e-3,
            weight_decay=0.0,
            optimizer="muon",
            momentum=momentum,
            nesterov=nesterov,
            betas=adam_betas,
            eps=adam_eps,
            lion_betas=lion_betas,
        )
        super().__init__(param_groups, defaults)
        for group in self.param_groups:
            if group["optimizer"] not in ("muon", "adam", "lion"):
                raise ValueError(f"unknown optimizer {group['optimizer']!r} in a param group")
            if group["optimizer"] == "muon":
                for p in group["params"]:
                    if p.dim() != 2:
                        raise ValueError(f"Muon takes 2-D parameters, got {tuple(p.shape)}")

    # ------------------------------------------------------------------ orthogonalization
    def _partition_dim(self, param) -> Optional[int]:
        """The dimension a TP-split weight is split along, None when it is whole (or blockwise)."""
        if self.tp_size == 1 or self.tp_mode == "blockwise":
            return None
        if not getattr(param, "tensor_model_parallel", False):
            return None
        dim = getattr(param, "partition_dim", -1)
        return dim if dim in (0, 1) else None

    def _orthogonalize_matrix(self, m: torch.Tensor, partition_dim: Optional[int]) -> torch.Tensor:
        full = [m.shape[0], m.shape[1]]
        if partition_dim is None:
            out = newton_schulz(m, self.coefficients, self.matmul_precision)
        elif self.tp_mode == "duplicated":
            rank = collectives.group_rank(self.tp_group)
            shards = [torch.empty_like(m) for _ in range(self.tp_size)]
            dist.all_gather(shards, m.contiguous(), group=self.tp_group)
            whole = torch.cat(shards, dim=partition_dim)
            out = newton_schulz(whole, self.coefficients, self.matmul_precision)
            out = out.chunk(self.tp_size, dim=partition_dim)[rank]
            full[partition_dim] *= self.tp_size
        else:  # distributed: the split dimension must be the one X X^T sums over
            out = newton_schulz(
                m,
                self.coefficients,
                self.matmul_precision,
                transpose=partition_dim == 0,
                tp_group=self.tp_group,
            )
            full[partition_dim] *= self.tp_size
        return out * (muon_scale_factor(*full, self.scale_mode) * self.extra_scale_factor)

    def orthogonalize(self, param: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """The scaled, orthogonalized update of ``param`` (Q, K, V apart for a QKV weight)."""
        partition_dim = self._partition_dim(param)
        if self.qkv_split is None or not getattr(param, "is_qkv", False):
            return self._orthogonalize_matrix(direction, partition_dim)
        per_group = sum(self.qkv_split)
        rows, cols = direction.shape
        if rows % per_group != 0:
            raise ValueError(
                f"QKV weight of {rows} rows is not a whole number of query groups of "
                f"{per_group} rows"
            )
        grouped = direction.view(rows // per_group, per_group, cols)
        parts = torch.split(grouped, list(self.qkv_split), dim=1)
        done = [
            self._orthogonalize_matrix(part.reshape(-1, cols), partition_dim).view(part.shape)
            for part in parts
        ]
        return torch.cat(done, dim=1).view(rows, cols)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            kind = group["optimizer"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if kind == "muon":
                    self._muon_update(p, group)
                elif kind == "adam":
                    self._adam_update(p, group)
                else:
                    self._lion_update(p, group)
        return loss

    def _muon_update(self, p, group):
        lr, beta = group["lr"], group["momentum"]
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        if group["weight_decay"] > 0.0:
            p.mul_(1.0 - lr * group["weight_decay"])
        buf.lerp_(p.grad, 1.0 - beta)
        direction = p.grad.lerp(buf, beta) if group["nesterov"] else buf
        with fp32_matmul_precision(self.matmul_precision):
            update = self.orthogonalize(p, direction.float())
        p.add_(update.to(p.dtype), alpha=-lr)

    def _adam_update(self, p, group):
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, device="cpu")  # host: read by .item() each step
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step = state["step"].item()
        exp_avg, exp_avg_sq, grad = state["exp_avg"], state["exp_avg_sq"], p.grad
        p.mul_(1.0 - lr * group["weight_decay"])
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**step))

    def _lion_update(self, p, group):
        lr, (beta1, beta2) = group["lr"], group["lion_betas"]
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        exp_avg = state["exp_avg"]
        p.mul_(1.0 - lr * group["weight_decay"])
        p.add_(exp_avg.lerp(p.grad, 1.0 - beta1).sign_(), alpha=-lr)
        exp_avg.lerp_(p.grad, 1.0 - beta2)
