"""Optimizer state as sharded entries keyed and sharded like the parameters it belongs to, in
Megatron-LM's keys.

Per parameter ``<key>`` (its global model key): ``optimizer.state.exp_avg.<key>``,
``optimizer.state.exp_avg_sq.<key>`` (Adam; ``momentum_buffer`` for SGD) and the fp32 main copy
of the weight: ``optimizer.state.fp32_param.<key>`` from a mixed-precision optimizer (only for
half-precision parameters), ``optimizer.state.param.<key>`` from the distributed optimizer (every
parameter). These are megatron-core's keys without the distributed optimizer and with it in its
``fully_reshardable`` sharding type; either loads into either optimizer here, at any layout.

* FP32 / mixed-precision optimizers hold each parameter's state whole: the entries are views of
  it (saved by the same rank that saves the parameter, loaded in place).
* The distributed optimizer holds flat slices: its state is gathered to DP rank 0 with
  ``get_parameter_state_dp_zero`` and cut back into per-parameter tensors there; loading fills
  per-parameter buffers on DP rank 0, packs them into the same flat layout and hands them to
  ``load_parameter_state_from_dp_zero``, which re-shards them over this run's DP group.

The non-tensor part (param-group hyperparameters, step count, grad scaler) is
:func:`optimizer_common_state`, in the structure megatron-core's optimizers give it (it goes
with the checkpoint's common state under ``optimizer``); :func:`content_metadata` is what
Megatron-LM stores beside it to say how the optimizer state was sharded.
Megatron-LM's default for the distributed optimizer, ``dp_reshardable`` (flat per-bucket
tensors ``optimizer.distributed.*`` tied to its own bucket layout), is read through
:mod:`.dp_reshardable` (``OptimizerLoad(..., bucket_state=...)``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .mapping import ShardedTensor

STATE_PREFIX = "optimizer.state."
FP32_PARAM = "fp32_param"
"""The fp32 main weights of a mixed-precision optimizer."""
MAIN_PARAM = "param"
"""The fp32 main weights of the distributed optimizer (Megatron's fully_reshardable name)."""
FULLY_RESHARDABLE = "fully_reshardable"
DP_RESHARDABLE = "dp_reshardable"
_GROUP_SETTINGS = (
    "params",
    "wd_mult",
    "lr_mult",
    "is_decoupled_lr",
    "is_expert_parallel",
    "max_lr",
    "min_lr",
    # How this run steps (optimizer_step_impl), not state: a checkpoint written on another
    # device (fused off on CPU) must not switch this run's fused step off.
    "fused",
    "foreach",
)
# "optimizer": Muon's groups name the update they take (muon, adam or lion); groups of
# different updates never match.
_SIGNATURE = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "optimizer")
_MUON_STATE = {
    "muon": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "lion": ("exp_avg",),
}


def state_key(name: str, param_key: str) -> str:
    return f"{STATE_PREFIX}{name}.{param_key}"


def is_distributed(optimizer) -> bool:
    return hasattr(optimizer, "get_parameter_state_dp_zero") and hasattr(
        optimizer, "load_parameter_state_from_dp_zero"
    )


def is_layer_wise(optimizer) -> bool:
    """Muon's layer-wise distributed optimizer: each DP rank holds the whole state of the params
    it owns (in its ``mixed_precision`` optimizer), and writes it."""
    return hasattr(optimizer, "is_owned") and hasattr(optimizer, "mixed_precision")


def _holder(optimizer):
    """The optimizer that holds the per-parameter state and the fp32 copies."""
    return optimizer.mixed_precision if is_layer_wise(optimizer) else optimizer


def _names_of(optimizer, group: dict) -> Tuple[str, ...]:
    """The state tensors of the params of ``group`` (Muon's groups each name their update)."""
    if "optimizer" in group and group["optimizer"] in _MUON_STATE:
        return _MUON_STATE[group["optimizer"]]
    return state_names(optimizer)


def state_names(optimizer) -> Tuple[str, ...]:
    """Per-parameter state tensors the inner torch optimizer keeps."""
    inner = optimizer.optimizer
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return ("exp_avg", "exp_avg_sq")
    if isinstance(inner, torch.optim.SGD):
        return ("momentum_buffer",) if any(g.get("momentum", 0) for g in inner.param_groups) else ()
    raise ValueError(f"cannot checkpoint the state of {type(inner).__name__} in torch_dist format")


def _main_params(optimizer) -> List[Tuple[torch.Tensor, torch.Tensor, bool, Tuple[str, ...]]]:
    """(model param, the param the inner optimizer updates, whether that is a separate fp32
    copy, the names of its state tensors)."""
    names = [_names_of(optimizer, group) for group in optimizer.param_groups]
    if hasattr(optimizer, "fp32_from_float16_groups"):
        pairs = [
            (p, m, True, names[g])
            for g, (halves, masters) in enumerate(
                zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
            )
            for p, m in zip(halves, masters)
        ]
        return pairs + [
            (p, p, False, names[g])
            for g, group in enumerate(optimizer.fp32_from_fp32_groups)
            for p in group
        ]
    return [
        (p, p, False, names[g])
        for g, group in enumerate(optimizer.param_groups)
        for p in group["params"]
    ]


def _main_to_group(optimizer) -> Dict[int, int]:
    return {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}


# ---------------------------------------------------------------------------------- common state
def _step_of_group(optimizer, group) -> int:
    steps = [optimizer.optimizer.state.get(p, {}).get("step") for p in group["params"]]
    steps = [int(s.item()) if torch.is_tensor(s) else int(s) for s in steps if s is not None]
    return max(steps) if steps else 0


def _megatron_groups(groups: List[dict]) -> List[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]


def optimizer_common_state(optimizer) -> Dict[str, Any]:
    """The optimizer's non-tensor state (param-group hyperparameters, step, grad scaler) in the
    structure megatron-core's optimizer of the same kind keeps in the checkpoint's common state:

    * distributed optimizer: ``{"optimizer": {"param_groups": [... "step"]},
      "param_state_sharding_type": "fully_reshardable"[, "grad_scaler"]}``;
    * mixed precision: ``{"optimizer": {"state": {"common_step"}, "param_groups"},
      "grad_scaler"}``;
    * fp32: ``{"state": {"common_step"}, "param_groups"}``.
    """
    optimizer = _holder(optimizer)
    scaler = getattr(optimizer, "grad_scaler", None)
    scaler_state = {"grad_scaler": scaler.state_dict()} if scaler is not None else {}
    if is_distributed(optimizer):
        groups = _megatron_groups(optimizer.state_dict()["optimizer"]["param_groups"])
        for group in groups:
            group["step"] = float(group.get("step", 0))
        return {
            "optimizer": {"param_groups": groups},
            "param_state_sharding_type": FULLY_RESHARDABLE,
            **scaler_state,
        }
    groups = _megatron_groups(optimizer.param_groups)
    step = max([_step_of_group(optimizer, g) for g in optimizer.param_groups] or [0])
    # megatron-core stores the step once for all parameters, and only once there is one.
    common_step = torch.tensor(float(step), device="cpu")  # host: a checkpoint entry
    inner = {"state": {"common_step": common_step} if step else {}}
    inner["param_groups"] = groups
    if hasattr(optimizer, "fp32_from_float16_groups"):
        return {"optimizer": inner, **scaler_state}
    return inner


def content_metadata(sharding_type: str = FULLY_RESHARDABLE) -> Dict[str, Any]:
    """Megatron-LM's ``content_metadata`` of a checkpoint whose distributed-optimizer state is
    in ``sharding_type`` (Megatron-LM reads the type from there when loading)."""
    return {
        "distrib_optim_sharding_type": sharding_type,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }


class UnreadableOptimizerState(ValueError):
    """The checkpoint's optimizer state is in a layout this code base does not read."""


def normalized_common_state(common: Dict[str, Any]) -> Dict[str, Any]:
    """``{"param_groups", "grad_scaler", "step"}`` of an optimizer's common state written by
    megatron-core (any of :func:`optimizer_common_state`'s structures) or by this code base
    before it wrote Megatron's (``{"param_groups", "grad_scaler", "has_state"}``)."""
    if "has_state" in common:  # written here before
        groups = list(common.get("param_groups") or [])
        step = max([int(g.get("step", 0)) for g in groups] or [0])
        return {"param_groups": groups, "grad_scaler": common.get("grad_scaler"), "step": step}
    sharding = common.get("param_state_sharding_type")
    # dp_reshardable's param groups are objects beside its tensors: the caller puts them in.
    readable = (FULLY_RESHARDABLE, DP_RESHARDABLE) if "optimizer" in common else ()
    if sharding is not None and sharding not in readable:
        raise UnreadableOptimizerState(
            f"the distributed optimizer's state is in Megatron-LM's {sharding} layout"
        )
    inner = common.get("optimizer", common)
    groups = [dict(g) for g in inner.get("param_groups") or []]
    if sharding is not None:
        step = max([int(g.get("step") or 0) for g in groups] or [0])
    else:
        step = inner.get("state", {}).get("common_step", 0)
        step = int(step.item()) if torch.is_tensor(step) else int(step or 0)
    for group in groups:
        group["step"] = step
    return {"param_groups": groups, "grad_scaler": common.get("grad_scaler"), "step": step}


def _aligned_groups(current: List[dict], saved: List[dict]) -> List[Optional[dict]]:
    """The saved group for each current one: same (wd_mult, lr_mult, ...) signature, else
    position."""
    by_signature = {}
    for group in saved:
        by_signature.setdefault(tuple(group.get(k) for k in _SIGNATURE), group)
    out = []
    for i, group in enumerate(current):
        match = by_signature.get(tuple(group.get(k) for k in _SIGNATURE))
        if match is None and len(saved) == len(current):
            match = saved[i]
        out.append(match)
    return out


def load_optimizer_common_state(optimizer, common: Dict[str, Any]) -> int:
    """Restore hyperparameters (not the per-run group settings such as wd_mult), the step count
    and the grad scaler from a checkpoint's optimizer common state (any structure
    :func:`normalized_common_state` reads). Call before loading the per-parameter state.
    Returns the step count (0: the optimizer had not stepped)."""
    common = normalized_common_state(common)
    optimizer = _holder(optimizer)
    saved = _aligned_groups(optimizer.param_groups, common["param_groups"])
    scaler_state = common["grad_scaler"]
    step = common["step"]
    if is_distributed(optimizer):
        groups = []
        for group, match in zip(optimizer.param_groups, saved):
            source = (
                match if match is not None else {k: v for k, v in group.items() if k != "params"}
            )
            groups.append({**source, "step": step})
        state = {"optimizer": {"param_groups": groups}}
        if scaler_state is not None:
            state["grad_scaler"] = scaler_state
        optimizer.load_state_dict(state)
        return step
    for group, match in zip(optimizer.param_groups, saved):
        if match is None:
            continue
        for key, value in match.items():
            if key not in _GROUP_SETTINGS and key != "step":
                group[key] = value
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None and scaler_state is not None:
        scaler.load_state_dict(scaler_state)
    return step


def _set_steps(optimizer, step: int) -> None:
    for group in optimizer.param_groups:
        # torch's Adam keeps the step on the parameter's device when fused or capturable (its
        # fused kernel refuses a host step: seen on a GPU resuming into fresh state), else on
        # the host.
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            state = optimizer.optimizer.state.get(p)
            if state is None:
                continue
            old = state.get("step")
            dtype = old.dtype if torch.is_tensor(old) else torch.float32
            device = (
                old.device
                if torch.is_tensor(old)
                else (p.device if on_device else torch.device("cpu"))
            )
            state["step"] = torch.tensor(float(step), dtype=dtype, device=device)


# ---------------------------------------------------------------------------------- save
def optimizer_sharded_state_dict(
    optimizer, by_param: Dict[int, ShardedTensor]
) -> Dict[str, ShardedTensor]:
    """Entries for the per-parameter optimizer state (a collective over DP for the distributed
    optimizer, whose entries then exist on DP rank 0 only)."""
    if is_distributed(optimizer):
        return _distributed_sharded_state_dict(optimizer, by_param)
    optimizer = _holder(optimizer)  # layer-wise: the params this DP rank owns
    out: Dict[str, ShardedTensor] = {}
    for param, main, separate, names in _main_params(optimizer):
        entry = by_param.get(id(param))
        if entry is None:
            continue
        state = optimizer.optimizer.state.get(main, {})
        for name in names:
            value = state.get(name)
            if torch.is_tensor(value):
                _add(out, entry.with_data(state_key(name, entry.key), value.detach()))
        if separate:
            _add(out, entry.with_data(state_key(FP32_PARAM, entry.key), main.detach()))
    return out


def _add(out: Dict[str, ShardedTensor], entry: ShardedTensor) -> None:
    out[entry.name] = entry


def _param_slices(optimizer):
    """(buffer index, dtype key, model param, bucket index, start within the bucket's flat
    state)."""
    for gbuf_idx, buffer in enumerate(optimizer.buffers):
        dtype_key = (buffer.param_dtype, buffer.grad_dtype)
        for param, (start, _end, bucket_id) in buffer.param_index_map.items():
            yield gbuf_idx, dtype_key, param, bucket_id, start - buffer.buckets[bucket_id].offset


def _distributed_sharded_state_dict(optimizer, by_param) -> Dict[str, ShardedTensor]:
    state = optimizer.get_parameter_state_dp_zero()
    if state is None:
        return {}
    out: Dict[str, ShardedTensor] = {}
    # Every distributed-optimizer instance gathers the same state: instance 0 writes it.
    other_instance = getattr(optimizer, "instance_rank", 0) != 0
    for gbuf_idx, dtype_key, param, bucket_id, start in _param_slices(optimizer):
        entry = by_param.get(id(param))
        if entry is None or gbuf_idx not in state:  # another rank gathered that buffer
            continue
        for name, flats in state[gbuf_idx][dtype_key].items():
            value = flats[bucket_id][start : start + param.numel()].view(entry.data.shape)
            # "param" (the fp32 main weight) is written for every parameter, as megatron-core's
            # fully_reshardable loader asks for it.
            replica = entry.replica or other_instance
            _add(out, entry.with_data(state_key(name, entry.key), value, replica=replica))
    return out


def distributed_state_by_param(optimizer) -> Optional[Dict[Tuple[int, str], torch.Tensor]]:
    """The distributed optimizer's per-parameter state gathered over DP (a collective):
    ``{(id(model param), name): flat fp32 tensor}`` for ``param`` (the main weights) and the
    state names, holding the buffers this rank is the state root of; None on other ranks."""
    state = optimizer.get_parameter_state_dp_zero()
    if state is None:
        return None
    out = {}
    for gbuf_idx, dtype_key, param, bucket_id, start in _param_slices(optimizer):
        if gbuf_idx not in state:  # another rank gathered that buffer
            continue
        for name, flats in state[gbuf_idx][dtype_key].items():
            out[(id(param), name)] = flats[bucket_id][start : start + param.numel()]
    return out


# ---------------------------------------------------------------------------------- load
class OptimizerLoad:
    """Targets to read the per-parameter optimizer state into, and the step that finishes it.

    ``targets`` (pass them to the checkpoint load with the model entries) then ``finish()``
    (a collective over DP for the distributed optimizer).
    """

    def __init__(
        self,
        optimizer,
        by_param: Dict[int, ShardedTensor],
        has_key: Callable[[str], bool],
        step: int,
        bucket_state=None,
    ):
        self.optimizer = optimizer
        # megatron-core's dp_reshardable state (a dp_reshardable.BucketStateLoad), read instead
        # of the per-parameter entries.
        self._bucket_state = bucket_state
        self.step = step
        self.targets: Dict[str, ShardedTensor] = {}
        self._buffers: Dict[Tuple[int, str], torch.Tensor] = {}
        self._has_key = has_key
        if bucket_state is not None:
            self.targets.update(bucket_state.targets)
        elif is_distributed(optimizer):
            self._prepare_distributed(by_param, state_names(optimizer))
        else:
            self._prepare_local(by_param)

    def _target(self, entry: ShardedTensor, name: str, data: torch.Tensor) -> None:
        _add(self.targets, entry.with_data(state_key(name, entry.key), data, replica=False))

    def _prepare_local(self, by_param) -> None:
        self._reload_masters = []
        for param, main, separate, names in _main_params(_holder(self.optimizer)):
            entry = by_param.get(id(param))
            if entry is None:
                continue
            state = self.optimizer.optimizer.state.setdefault(main, {})
            for name in names:
                value = state.get(name)
                if not torch.is_tensor(value) or value.shape != main.shape:
                    value = torch.zeros_like(main, memory_format=torch.preserve_format)
                    state[name] = value
                self._target(entry, name, value.view(entry.data.shape))
            if separate:
                saved_as = self._main_param_name(entry)
                if saved_as is not None:
                    self._target(entry, saved_as, main.detach().view(entry.data.shape))
                else:
                    self._reload_masters.append((param, main))

    def _main_param_name(self, entry: ShardedTensor) -> Optional[str]:
        """Under which name the checkpoint holds this parameter's fp32 main weight, if at all."""
        for name in (FP32_PARAM, MAIN_PARAM):
            if self._has_key(state_key(name, entry.key)):
                return name
        return None

    def _prepare_distributed(self, by_param, names) -> None:
        # Rank 0 of each buffer's (expert-)DP group reads; load_parameter_state_from_dp_zero
        # re-shards.
        for gbuf_idx, _d, param, _b, _s in _param_slices(self.optimizer):
            entry = by_param.get(id(param))
            if entry is None or not self.optimizer.is_state_root(gbuf_idx):
                continue
            wanted = [(name, name) for name in names]
            saved_as = self._main_param_name(entry)
            if param.dtype != torch.float32 and saved_as is not None:
                wanted.append((saved_as, MAIN_PARAM))
            for saved_name, name in wanted:
                buf = torch.zeros(entry.data.shape, dtype=torch.float32, device=param.device)
                self._buffers[(id(param), name)] = buf
                self._target(entry, saved_name, buf)

    @torch.no_grad()
    def finish(self) -> None:
        if is_distributed(self.optimizer):
            self._finish_distributed()
            return
        for param, main in self._reload_masters:
            main.copy_(param.detach().view_as(main))
        _set_steps(_holder(self.optimizer), self.step)

    def _finish_distributed(self) -> None:
        optimizer = self.optimizer
        if self._bucket_state is not None:
            self._buffers.update(self._bucket_state.values())
        if not optimizer.holds_any_state_root():
            optimizer.load_parameter_state_from_dp_zero(None)
            return
        keys = (MAIN_PARAM,) + state_names(optimizer)
        state: Dict[Any, Any] = {}
        for gbuf_idx, buffer in enumerate(optimizer.buffers):
            if not optimizer.is_state_root(gbuf_idx):
                continue
            flats = {
                key: [
                    torch.zeros(
                        b.numel_unpadded, dtype=torch.float32, device=buffer.grad_data.device
                    )
                    for b in buffer.buckets
                ]
                for key in keys
            }
            state[gbuf_idx] = {(buffer.param_dtype, buffer.grad_dtype): flats}
        for gbuf_idx, dtype_key, param, bucket_id, start in _param_slices(optimizer):
            if gbuf_idx not in state:
                continue
            flats = state[gbuf_idx][dtype_key]
            for key in keys:
                value = self._buffers.get((id(param), key))
                if value is None and key == MAIN_PARAM:
                    value = param.detach().float()  # fp32 weights (or no fp32 copy saved)
                if value is not None:
                    flats[key][bucket_id][start : start + param.numel()].copy_(value.reshape(-1))
        optimizer.load_parameter_state_from_dp_zero(state)
