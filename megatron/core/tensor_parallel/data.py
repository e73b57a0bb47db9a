"""Broadcast a micro-batch from tensor-parallel rank 0 to the other ranks of its TP group.

Only TP rank 0 needs to read the data; the others receive the same tensors (Megatron's
``get_batch`` pattern). Shapes and dtypes travel first, so receivers need no prior knowledge.
"""

from typing import Dict, Optional, Sequence

import torch

from megatron.core.device import collective_device
from megatron.core.tensor_parallel import collectives as C

_DTYPES = [
    torch.int64,
    torch.int32,
    torch.float32,
    torch.bool,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int16,
    torch.int8,
]


def broadcast_data(
    keys: Sequence[str], data: Optional[Dict[str, Optional[torch.Tensor]]], tp_group, device=None
) -> Dict[str, Optional[torch.Tensor]]:
    """Return ``{key: tensor}`` for ``keys`` on every rank of ``tp_group``, taken from ``data`` on
    TP rank 0 (``data`` is ignored elsewhere and may be None). Missing/None entries stay None."""
    if C.group_size(tp_group) == 1:
        return {k: (data or {}).get(k) for k in keys}
    src = C.group_rank(tp_group) == 0
    if device is None:
        device = collective_device(tp_group)
    max_dims = 8
    # Per key: present flag, dtype code, ndim, shape (padded to max_dims).
    meta = torch.zeros(len(keys), 3 + max_dims, dtype=torch.int64, device=device)
    if src:
        for i, key in enumerate(keys):
            t = data.get(key) if data is not None else None
            if t is None:
                continue
            if t.dtype not in _DTYPES or t.dim() > max_dims:
                raise ValueError(
                    f"broadcast_data: cannot send '{key}' of dtype {t.dtype} and {t.dim()} dims"
                )
            meta[i, 0], meta[i, 1], meta[i, 2] = 1, _DTYPES.index(t.dtype), t.dim()
            meta[i, 3 : 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64, device=device)
    C.broadcast(meta, 0, tp_group)
    out = {}
    for i, key in enumerate(keys):
        present, code, ndim = meta[i, :3].tolist()
        if not present:
            out[key] = None
            continue
        shape = meta[i, 3 : 3 + ndim].tolist()
        dtype = _DTYPES[code]
        if src:
            t = data[key].to(device).contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        # gloo cannot broadcast bool tensors: send them as uint8.
        wire = t.to(torch.uint8) if dtype == torch.bool else t
        C.broadcast(wire, 0, tp_group)
        out[key] = wire.to(torch.bool) if dtype == torch.bool else wire
    return out
