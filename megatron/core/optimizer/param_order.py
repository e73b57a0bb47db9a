"""The order in which optimizer state is paired with parameters, and this code base's older one.

torch's ``Optimizer.state_dict()`` numbers the parameters of its param groups 0, 1, ... in the
order the groups list them, and ``load_state_dict()`` pairs saved state with parameters by that
number; Megatron's torch-format ``model_optim_rng.pt`` stores exactly that. The groups are built
from ``model.named_parameters()``, i.e. in the modules' registration order. megatron-core
registers each attention's ``linear_proj`` before its ``linear_qkv`` (cross-attention:
``linear_proj``, ``linear_q``, ``linear_kv``) and BERT's ``binary_head`` before its ``pooler``;
this code base registers them the same way, and marks the files it writes with
:data:`PARAM_ORDER_KEY`. Files written here before that listed those parameters in the order of
:data:`LEGACY_CHILD_ORDER` (a model class gives its own children's old order as its
``LEGACY_CHILD_ORDER`` attribute); :func:`legacy_positions` tells where each parameter sits
there, so that their state can be moved to the current positions.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence

import torch

PARAM_ORDER_KEY = "param_order"
"""Top-level key of ``model_optim_rng.pt`` naming the order of its optimizer state."""
PARAM_ORDER = "megatron-core"
"""Its value: parameters in megatron-core's registration order (Megatron-LM reads it as its
own; it ignores the key)."""

LEGACY_CHILD_ORDER = {
    "SelfAttention": ("linear_qkv", "q_layernorm", "k_layernorm", "core_attention", "linear_proj"),
    "CrossAttention": ("linear_q", "linear_kv", "core_attention", "linear_proj"),
}
"""Per attention class: the relative order in which this code base registered those children
before it followed megatron-core (the other children kept their places)."""


def _legacy_children(module: torch.nn.Module) -> List[torch.nn.Module]:
    names = [name for name, child in module._modules.items() if child is not None]
    rule = LEGACY_CHILD_ORDER.get(type(module).__name__) or getattr(
        type(module), "LEGACY_CHILD_ORDER", ()
    )
    if rule:
        moved = [name for name in rule if name in names]
        slots = iter(moved)
        # The moved children fill the slots they occupy now, in their old relative order.
        names = [next(slots) if name in moved else name for name in names]
    return [module._modules[name] for name in names]


def legacy_parameter_order(chunks: Iterable[torch.nn.Module]) -> List[torch.nn.Parameter]:
    """The parameters of ``chunks`` in the order ``named_parameters()`` listed them before this
    code base followed megatron-core's registration order (each parameter once)."""
    seen_params, seen_modules, order = set(), set(), []

    def walk(module: torch.nn.Module) -> None:
        if id(module) in seen_modules:
            return
        seen_modules.add(id(module))
        for param in module._parameters.values():
            if param is not None and id(param) not in seen_params:
                seen_params.add(id(param))
                order.append(param)
        for child in _legacy_children(module):
            walk(child)

    for chunk in chunks:
        walk(chunk)
    return order


def legacy_positions(
    params: Sequence[torch.Tensor], legacy_rank: Dict[int, int], ranks: Sequence[int] = ()
) -> List[int]:
    """For each of ``params`` (a list in the current order), its position in the same list
    ordered the legacy way (``legacy_rank``: id(param) -> rank in the legacy order; or the
    ranks given as ``ranks``)."""
    ranks = list(ranks) or [legacy_rank[id(p)] for p in params]
    legacy = sorted(range(len(ranks)), key=lambda k: ranks[k])
    positions = [0] * len(ranks)
    for position, k in enumerate(legacy):
        positions[k] = position
    return positions


def legacy_group_positions(
    groups: Sequence[Sequence[torch.Tensor]], legacy_rank: Dict[int, int]
) -> List[int]:
    """For each param group (current order), its position among the groups as this code base
    ordered them before: by the first of their parameters in the legacy order."""
    firsts = [min((legacy_rank[id(p)] for p in group), default=-1) for group in groups]
    return legacy_positions([], {}, firsts)


def reorder_legacy_inner_state(
    inner: Dict[str, Any], groups: Sequence[Sequence[torch.Tensor]], legacy_rank: Dict[int, int]
) -> Dict[str, Any]:
    """A copy of a torch optimizer state dict saved in the legacy order whose param groups
    follow the current order of ``groups`` (the model parameters of each group) and list the
    saved parameter numbers in the current order; left as it is when the number of groups or
    of a group's parameters does not match (the load refuses it)."""
    saved = list(inner.get("param_groups", []))
    if len(saved) != len(groups):
        return inner
    saved = [saved[g] for g in legacy_group_positions(groups, legacy_rank)]
    saved_groups = []
    for group, saved_group in zip(groups, saved):
        ids = list(saved_group.get("params", []))
        if len(ids) == len(group):
            ids = [ids[p] for p in legacy_positions(group, legacy_rank)]
        saved_groups.append({**saved_group, "params": ids})
    return {**inner, "param_groups": saved_groups}


def reorder_legacy_lists(
    lists: Sequence[Sequence[Any]],
    groups: Sequence[Sequence[torch.Tensor]],
    members: Sequence[Sequence[torch.Tensor]],
    legacy_rank: Dict[int, int],
) -> List[List[Any]]:
    """Per-group lists saved in the legacy order, each holding a value per parameter of
    ``members`` (e.g. the fp32 master copies of each group's half-precision parameters), in the
    current order of ``groups`` and ``members``; left as they are when the counts differ."""
    if len(lists) != len(groups):
        return [list(v) for v in lists]
    lists = [lists[g] for g in legacy_group_positions(groups, legacy_rank)]
    out = []
    for values, group in zip(lists, members):
        values = list(values)
        if len(values) == len(group):
            values = [values[p] for p in legacy_positions(group, legacy_rank)]
        out.append(values)
    return out


def state_fits(inner: Dict[str, Any], groups: Sequence[Sequence[torch.Tensor]]) -> bool:
    """Whether every tensor of the saved per-parameter state has the shape of the parameter it
    would be paired with (by position, group by group)."""
    state = inner.get("state", {})
    for group, saved in zip(groups, inner.get("param_groups", [])):
        for param, index in zip(group, saved.get("params", [])):
            for value in state.get(index, {}).values():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                    return False
    return True
