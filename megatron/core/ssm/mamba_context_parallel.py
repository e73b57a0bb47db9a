"""Context parallelism for Mamba layers, as Megatron does it: an all-to-all over the CP group.

Outside the convolution and the scan a CP rank holds its part of the sequence with all of its
TP rank's heads; the convolution and the scan need the whole sequence, in order. So before them
an all-to-all gives each CP rank the whole sequence of 1/CP of the heads (with their groups' B
and C), and after them a second all-to-all brings the outputs back to the sequence layout::

    [s/CP, b, heads/TP]  --to_head_sharded-->  [s, b, heads/(TP*CP)]  --conv, scan-->
    [s, b, heads/(TP*CP)]  --to_sequence_sharded-->  [s/CP, b, heads/TP]

Heads are dealt out in order: CP rank r gets heads [r*k, (r+1)*k) of its TP rank's heads
(k = heads / (TP*CP)). When a TP rank has fewer groups than there are CP ranks, each group's
B and C go to the ``group_repeat`` consecutive CP ranks that share its heads (Megatron's
replication; the gradients of the copies add up in backward).

The sequence a CP rank holds is in the load-balanced order of attention (rank r holds chunks r
and 2*CP-1-r of 2*CP, see :mod:`megatron.core.transformer.context_parallel`); the head-sharded
sequence is put back in global order before the convolution and returned to the balanced order
after the scan, so attention layers and Mamba layers can follow one another.

Unlike Megatron, the gate ``z`` does not travel: ``RMSNorm(y * silu(z))`` is taken after the
return trip, where the rank holds ``z`` for its own tokens (the same numbers, one all-to-all less
each way). x, B, C and dt travel in one all-to-all.

Parameters are not split over CP: every CP rank holds the TP rank's full ``conv1d``, ``dt_bias``,
``A_log`` and ``D`` and uses the slices of its heads (:meth:`conv_slice`, :meth:`head_slice`), so
gradients land on those slices and the data x context-parallel gradient reduction sums them into
the full gradient; checkpoints are those of CP=1.
"""

from typing import Optional, Tuple

import torch

from megatron.core.tensor_parallel.collectives import group_rank, group_size
from megatron.core.tensor_parallel.mappings import all_to_all
from megatron.core.transformer.context_parallel import cp_chunk_indices


def mamba_context_parallel_error(nheads: int, ngroups: int, tp: int, cp: int) -> Optional[str]:
    """Why Mamba layers of ``nheads`` heads in ``ngroups`` groups cannot run at TP ``tp`` x CP
    ``cp`` (Megatron's rules: each CP rank gets whole heads, and whole groups or an equal share
    of one group's heads), or None when they can."""
    if cp == 1:
        return None
    if nheads % (tp * cp):
        return (
            f"the Mamba heads ({nheads}) must be divisible by --tensor-model-parallel-size x "
            f"--context-parallel-size ({tp} x {cp})"
        )
    groups_tp = ngroups // tp
    if groups_tp < cp and cp % groups_tp:
        return (
            f"--context-parallel-size ({cp}) must be divisible by --mamba-num-groups / "
            f"--tensor-model-parallel-size ({ngroups} / {tp}) when it is larger"
        )
    if groups_tp >= cp and groups_tp % cp:
        return (
            f"--mamba-num-groups ({ngroups}) must be divisible by --tensor-model-parallel-size x "
            f"--context-parallel-size ({tp} x {cp})"
        )
    return None


class MambaContextParallel:
    """The layout changes and parameter slices of one Mamba mixer on one CP rank. Holds no
    parameters (not a module: nothing of it is saved). ``nheads`` and ``ngroups``: the heads
    and groups of the TP rank (of ``tp_size``); ``headdim`` and ``d_state`` as the mixer's."""

    def __init__(
        self, cp_group, nheads: int, ngroups: int, headdim: int, d_state: int, tp_size: int = 1
    ):
        self.group = cp_group
        self.size = group_size(cp_group)
        self.rank = group_rank(cp_group)
        self.headdim, self.d_state = headdim, d_state
        self.nheads_tp, self.ngroups_tp = nheads, ngroups
        error = mamba_context_parallel_error(
            nheads * tp_size, ngroups * tp_size, tp_size, self.size
        )
        if error is not None:
            raise ValueError(error)
        self.nheads = nheads // self.size
        self.group_repeat = max(1, self.size // ngroups)
        self.ngroups = max(1, ngroups // self.size)
        self.d_inner = self.nheads * headdim

    # ------------------------------------------------------------------ parameter slices
    def head_slice(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's heads of a per-head parameter (``dt_bias``, ``A_log``, ``D``)."""
        if self.size == 1:
            return param
        return param[self.rank * self.nheads : (self.rank + 1) * self.nheads]

    def conv_slice(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's channels [x; B; C] of a ``conv1d`` parameter of the TP rank (dim 0)."""
        if self.size == 1:
            return param
        gn = self.ngroups_tp * self.d_state
        x, B, C = torch.split(param, [self.nheads_tp * self.headdim, gn, gn], dim=0)
        start = self.rank * self.d_inner
        group_n = self.ngroups * self.d_state
        group_start = (self.rank // self.group_repeat) * group_n
        return torch.cat(
            [
                x[start : start + self.d_inner],
                B[group_start : group_start + group_n],
                C[group_start : group_start + group_n],
            ]
        )

    # ------------------------------------------------------------------ layouts
    def _positions(self, local_len: int, device) -> torch.Tensor:
        """Global positions of the rows of the head-sharded sequence as the all-to-all delivers
        it: CP rank 0's tokens, then rank 1's, ... (each in its load-balanced order)."""
        return torch.cat(
            [cp_chunk_indices(local_len, self.size, r, device=device) for r in range(self.size)]
        )

    def to_head_sharded(
        self, xbc: torch.Tensor, dt: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """xbc [s/CP, b, x B C of the TP rank], dt [s/CP, b, heads of the TP rank] ->
        (xbc [s, b, this rank's x B C], dt [s, b, this rank's heads]), in global order."""
        if self.size == 1:
            return xbc, dt
        local_len, batch = xbc.shape[:2]
        gn = self.ngroups_tp * self.d_state
        x, B, C = torch.split(xbc, [self.nheads_tp * self.headdim, gn, gn], dim=-1)
        if self.group_repeat > 1:
            B, C = self._repeat_groups(B), self._repeat_groups(C)
        # Every part cut into CP pieces; piece r of each part, side by side, goes to rank r.
        parts = [t.unflatten(-1, (self.size, -1)) for t in (x, B, C, dt)]
        sizes = [p.shape[-1] for p in parts]
        send = torch.cat(parts, dim=-1).permute(2, 0, 1, 3)  # [CP, s/CP, b, piece]
        rows = local_len * batch
        received = all_to_all(
            send.reshape(self.size * rows, -1), self.group, [rows] * self.size, [rows] * self.size
        ).reshape(self.size * local_len, batch, -1)
        order = torch.argsort(self._positions(local_len, received.device))
        received = received.index_select(0, order)
        x, B, C, dt = torch.split(received, sizes, dim=-1)
        return torch.cat([x, B, C], dim=-1), dt

    def to_sequence_sharded(self, y: torch.Tensor) -> torch.Tensor:
        """y [s, b, this rank's channels] in global order -> [s/CP, b, the TP rank's channels]
        in this rank's load-balanced order (the inverse of :meth:`to_head_sharded` for x)."""
        if self.size == 1:
            return y
        length, batch, width = y.shape
        local_len = length // self.size
        y = y.index_select(0, self._positions(local_len, y.device))
        rows = local_len * batch
        received = all_to_all(
            y.reshape(self.size * rows, width), self.group, [rows] * self.size, [rows] * self.size
        )
        # Block r holds this rank's tokens of rank r's heads: heads in rank order.
        return received.reshape(self.size, local_len, batch, width).permute(1, 2, 0, 3).flatten(2)

    def _repeat_groups(self, t: torch.Tensor) -> torch.Tensor:
        """[..., g * n] -> [..., g * repeat * n]: each group's block repeated in place, so that
        its copies go to the consecutive CP ranks holding its heads."""
        groups = t.unflatten(-1, (self.ngroups_tp, self.d_state))
        return groups.repeat_interleave(self.group_repeat, dim=-2).flatten(-2)
