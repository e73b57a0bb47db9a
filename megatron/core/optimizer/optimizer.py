"""Megatron optimizer wrappers around a torch optimizer.

FP32Optimizer: fp32 model params, grads taken from ``param.main_grad`` (DDP) or ``param.grad``.
Float16OptimizerWithFloat16Params: fp16/bf16 model params with fp32 master copies that the
inner optimizer updates; gradients are copied to the masters, unscaled and checked for
inf/NaN, and the updated masters are copied back (rounded) into the model params.

Both return ``(update_successful, grad_norm, num_zeros_in_grad)`` from step().
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.device import compute_device
from megatron.core.timers import DummyTimer

from .clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    param_is_counted_once,
)
from .grad_scaler import MegatronGradScaler
from .optimizer_config import OptimizerConfig
from .param_order import reorder_legacy_inner_state, reorder_legacy_lists, state_fits

_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Attributes that decide how a param enters norms/zero counts; copied onto master params.
_PARALLEL_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "shared",
    "allreduce",
)


@dataclass(frozen=True)
class MainParamCopy:
    """The fp32 main copy an optimizer keeps of a half-precision model param, on this rank.

    ``shard_group`` None: ``data`` is the whole param. Otherwise ``data`` is this rank's part of
    it (None: no part here) and the parts on the ranks of ``shard_group`` make up the param once.
    """

    data: Optional[torch.Tensor]
    shard_group: Any = None


def _is_expert(param: torch.Tensor) -> bool:
    """Expert parameters (MoE) are the ones DDP does not all-reduce over the full DP group."""
    return not getattr(param, "allreduce", True)


def _zero_grad_group(params: List[torch.Tensor], set_to_none: bool) -> None:
    for param in params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            if param.grad.grad_fn is not None:
                param.grad.detach_()
            else:
                param.grad.requires_grad_(False)
            param.grad.zero_()


def as_float32(
    tensors: List[Optional[torch.Tensor]], foreach: bool
) -> List[Optional[torch.Tensor]]:
    """``tensors`` in fp32 (None stays None, an fp32 tensor is returned as it is): with
    ``foreach`` the conversions are one multi-tensor copy, else one ``.float()`` per tensor."""
    if not foreach:
        return [None if t is None else t.float() for t in tensors]
    out = list(tensors)
    todo = [i for i, t in enumerate(tensors) if t is not None and t.dtype != torch.float32]
    if todo:
        copies = [torch.empty_like(tensors[i], dtype=torch.float32) for i in todo]
        torch._foreach_copy_(copies, [tensors[i] for i in todo])
        for i, copy in zip(todo, copies):
            out[i] = copy
    return out


@torch.no_grad()
def copy_tensors(dst: List[torch.Tensor], src: List[torch.Tensor], foreach: bool) -> None:
    """``dst[i].copy_(src[i])`` for every i (rounding to dst's dtype): with ``foreach`` as one
    multi-tensor copy, which rounds as copy_ does."""
    if not dst:
        return
    if foreach:
        torch._foreach_copy_(dst, src)
    else:
        for target, source in zip(dst, src):
            target.copy_(source)


def place_step_tensors(optimizer: torch.optim.Optimizer) -> None:
    """Put each param's ``step`` count where torch.optim's step of its group expects it: on the
    param's device (fp32) for a fused or capturable group, on the host otherwise. A loaded
    checkpoint (or a distrib_optim.pt re-shard) may have made it on the other side, which would
    fail the fused kernel or read the step back to the host for every param."""
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            state = optimizer.state.get(param)
            step = None if state is None else state.get("step")
            if not torch.is_tensor(step):
                continue
            if on_device and (step.device != param.device or step.dtype != torch.float32):
                state["step"] = step.to(device=param.device, dtype=torch.float32)
            elif not on_device and step.device.type != "cpu":
                state["step"] = step.to(device="cpu")  # host: where torch.optim keeps it


def _model_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The DP-reduced gradient of a model param: main_grad (DDP buffer) if present, else .grad."""
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


class MegatronOptimizer:
    """Common interface; subclasses implement the precision-specific parts of step()."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        model_parallel_group=None,
        tp_rank: int = 0,
    ):
        self.optimizer = optimizer
        self.config = config
        self.model_parallel_group = model_parallel_group
        self.tp_rank = tp_rank
        self.expert_parallel_group = None
        """With MoE: the ranks holding different expert parameters (``allreduce = False``):
        expert-tensor x expert x pipeline parallel. Their grads enter norms, zero counts and the
        inf check over this group (set by the trainer; None: one process or no experts)."""
        self.expert_tp_rank = 0
        """This rank's expert-tensor-parallel rank (unsharded expert params count there once)."""
        self._dummy_timer = DummyTimer()
        params = self.get_parameters()
        self._device = params[0].device if params else compute_device()

    # ------------------------------------------------------------------ helpers
    def _timer(self, name: str):
        timers = self.config.timers
        return self._dummy_timer if timers is None else timers(name, log_level=1)

    def _start(self, name: str):
        timer = self._timer(name)
        timer.start(barrier=self.config.barrier_with_L1_time)
        return timer

    def get_parameters(self) -> List[torch.Tensor]:
        """The params the inner optimizer updates (master params on the half path)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def get_main_grads_for_grad_norm(self, expert: Optional[bool] = None) -> List[torch.Tensor]:
        """The grads this rank counts: all (``expert`` None), dense or expert ones only."""
        if expert is None:
            return [
                p.grad
                for p in self.get_parameters()
                if p.grad is not None and param_is_counted_once(p, self.tp_rank)
            ]
        return [
            p.grad
            for p in self.get_parameters()
            if p.grad is not None
            and _is_expert(p) == expert
            and param_is_counted_once(p, self.expert_tp_rank if expert else self.tp_rank)
        ]

    @property
    def _foreach(self) -> bool:
        """Whether grad norms and copies run as multi-tensor operations."""
        return self.config.foreach_grad_norm_and_copies

    def get_grad_norm(self) -> float:
        if self.expert_parallel_group is None:
            return get_grad_norm_fp32(
                self.get_main_grads_for_grad_norm(),
                model_parallel_group=self.model_parallel_group,
                foreach=self._foreach,
            )
        dense = get_grad_norm_fp32(
            self.get_main_grads_for_grad_norm(expert=False),
            model_parallel_group=self.model_parallel_group,
            foreach=self._foreach,
        )
        expert = get_grad_norm_fp32(
            self.get_main_grads_for_grad_norm(expert=True),
            model_parallel_group=self.expert_parallel_group,
            foreach=self._foreach,
        )
        return math.sqrt(dense * dense + expert * expert)

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip the main grads to `clip_grad` global L2 norm; return the norm before clipping."""
        grad_norm = self.get_grad_norm()
        clip_grad_by_total_norm_fp32(self.get_parameters(), clip_grad, grad_norm)
        return grad_norm

    def count_zeros(self) -> int:
        params = self.get_parameters()
        if self.expert_parallel_group is None:
            return count_zeros_fp32(
                params, grad_stats_parallel_group=self.model_parallel_group, tp_rank=self.tp_rank
            )
        dense = [p for p in params if not _is_expert(p)]
        expert = [p for p in params if _is_expert(p)]
        return count_zeros_fp32(
            dense, grad_stats_parallel_group=self.model_parallel_group, tp_rank=self.tp_rank
        ) + count_zeros_fp32(
            expert,
            grad_stats_parallel_group=self.expert_parallel_group,
            tp_rank=self.expert_tp_rank,
        )

    def _clip_count_and_step(self) -> Tuple[Optional[float], Optional[int]]:
        timer = self._start("optimizer-clip-main-grad")
        grad_norm = None
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        timer.stop()

        timer = self._start("optimizer-count-zeros")
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        timer.stop()

        timer = self._start("optimizer-inner-step")
        self.optimizer.step()
        timer.stop()
        return grad_norm, num_zeros

    # ------------------------------------------------------------------ interface
    def get_loss_scale(self) -> torch.Tensor:
        raise NotImplementedError

    def main_param_copies(self) -> Dict[torch.Tensor, MainParamCopy]:
        """Model param -> the fp32 main copy this optimizer keeps of it (none: fp32 params are
        their own main params). --log-params-norm reads them with --bf16: Megatron's
        calc_params_l2_norm also takes a bf16 parameter's fp32 main copy."""
        return {}

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the loss scale before backward (keeps the loss's shape)."""
        scale = self.get_loss_scale()
        return loss.float() * scale.to(loss.device).reshape(())

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError

    def reload_model_params(self) -> None:
        """Refresh master params from the model params (after loading model weights)."""

    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        raise NotImplementedError

    def _step_on_main_params(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """The step of optimizers that keep fp32 main params apart from the model params: copy
        the grads in, unscale and check (an inf/NaN skips the step), clip and step, copy the
        params back. Subclasses supply the copies and ``_after_main_params_copied`` /
        ``_release_grads``."""
        timer = self._start("optimizer-copy-to-main-grad")
        self._copy_model_grads_to_main_grads()
        timer.stop()

        if self.grad_scaler is not None:
            timer = self._start("optimizer-unscale-and-check-inf")
            found_inf = self._unscale_main_grads_and_check_for_nan()
            timer.stop()
            if found_inf:
                self.grad_scaler.update(True)
                self._release_grads()
                return False, None, None

        grad_norm, num_zeros = self._clip_count_and_step()

        timer = self._start("optimizer-copy-main-to-model-params")
        self._copy_main_params_to_model_params()
        timer.stop()
        self._after_main_params_copied()

        if self.grad_scaler is not None:
            self.grad_scaler.update(False)
        self._release_grads()
        return True, grad_norm, num_zeros

    def _after_main_params_copied(self) -> None:
        """Hook after a successful step's copy of the main params into the model params."""

    def _release_grads(self) -> None:
        """Hook at the end of every step (taken or skipped)."""

    def state_dict(self) -> Dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        raise NotImplementedError

    def model_param_groups(self) -> List[List[torch.Tensor]]:
        """Each param group's model parameters, in the group's (the state's) order."""
        return [list(group["params"]) for group in self.optimizer.param_groups]

    def state_dict_in_current_order(
        self, state_dict: Dict[str, Any], legacy_rank: Dict[int, int]
    ) -> Optional[Dict[str, Any]]:
        """``state_dict`` (as :meth:`state_dict` returns it) moved from this code base's legacy
        parameter order (``legacy_rank``, see param_order.py) to the current one, when its
        per-parameter state fits the legacy order and not the current one; else None (use it
        as it is: a file in the current order, or one that fits neither, which the load
        refuses)."""
        inner_key = next(
            (k for k in ("optimizer", "optimizer_state_dict") if k in state_dict), None
        )
        inner = state_dict if "param_groups" in state_dict else state_dict.get(inner_key)
        if not isinstance(inner, dict) or not inner.get("state"):
            return None
        groups = self.model_param_groups()
        if state_fits(inner, groups):
            return None
        moved = reorder_legacy_inner_state(inner, groups, legacy_rank)
        if not state_fits(moved, groups):
            return None
        if inner is state_dict:
            return moved
        out = {**state_dict, inner_key: moved}
        half_groups = getattr(self, "float16_groups", None)
        if half_groups is not None and "fp32_from_fp16_params" in out:
            out["fp32_from_fp16_params"] = reorder_legacy_lists(
                out["fp32_from_fp16_params"], groups, half_groups, legacy_rank
            )
        return out

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The inner optimizer's param groups (the scheduler sets 'lr' and 'weight_decay')."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    def _load_inner_state_dict(self, inner_state: Dict[str, Any]) -> None:
        # Group settings that come from the current config (not training progress) survive the
        # load, so --override-opt-param-scheduler and a changed --decoupled-lr take effect.
        keep = [
            {
                k: group[k]
                for k in (
                    "wd_mult",
                    "lr_mult",
                    "is_decoupled_lr",
                    "is_expert_parallel",
                    "max_lr",
                    "min_lr",
                    # How the step runs (optimizer_step_impl), not state: a checkpoint written
                    # by another implementation must not switch this run's off.
                    "fused",
                    "foreach",
                )
                if k in group
            }
            for group in self.optimizer.param_groups
        ]
        _check_state_shapes(self.optimizer.param_groups, inner_state)
        try:
            self.optimizer.load_state_dict(inner_state)
        except (ValueError, KeyError) as exc:
            raise ValueError(
                f"optimizer state in the checkpoint does not match this model: {exc}"
            ) from exc
        for group, kept in zip(self.optimizer.param_groups, keep):
            group.update(kept)
        place_step_tensors(self.optimizer)


def _check_state_shapes(groups: List[Dict[str, Any]], inner_state: Dict[str, Any]) -> None:
    """torch optimizers pair saved state with parameters by position (group by group); refuse a
    state whose tensors do not have the shape of the parameter at their position, which torch
    would accept and the first step would trip over."""
    saved_state = inner_state.get("state", {})
    for g, (group, saved) in enumerate(zip(groups, inner_state.get("param_groups", []))):
        for k, (param, index) in enumerate(zip(group["params"], saved.get("params", []))):
            for name, value in saved_state.get(index, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                    raise ValueError(
                        f"the state {name!r} of parameter {k} of group {g} has shape "
                        f"{tuple(value.shape)}, this model's parameter there "
                        f"{tuple(param.shape)}: the checkpoint lists the parameters in another "
                        "order or is of another model"
                    )


class FP32Optimizer(MegatronOptimizer):
    """fp32 params: the inner optimizer runs directly on the model params."""

    def __init__(self, optimizer, config, model_parallel_group=None, tp_rank: int = 0):
        super().__init__(optimizer, config, model_parallel_group, tp_rank)
        self._scale = torch.tensor([1.0], dtype=torch.float32, device=self._device)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        _zero_grad_group(self.get_parameters(), set_to_none)

    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        timer = self._start("optimizer-copy-to-main-grad")
        from_main_grad = []
        for param in self.get_parameters():
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                param.grad = (
                    main_grad if main_grad.dtype == param.dtype else main_grad.to(param.dtype)
                )
                from_main_grad.append(param)
        timer.stop()

        grad_norm, num_zeros = self._clip_count_and_step()

        # .grad aliases the DDP buffer; drop the alias so a later backward cannot accumulate
        # into the buffer through it as well as through the DDP hook.
        for param in from_main_grad:
            param.grad = None
        return True, grad_norm, num_zeros

    def state_dict(self) -> Dict[str, Any]:
        # Megatron stores the bare torch optimizer state for the fp32 optimizer.
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "optimizer" in state_dict and "param_groups" not in state_dict:
            state_dict = state_dict["optimizer"]
        self._load_inner_state_dict(state_dict)


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """fp16/bf16 model params with fp32 master params (fp32 model params are used as they are)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        model_parallel_group=None,
        tp_rank: int = 0,
    ):
        if config.fp16 and grad_scaler is None:
            raise ValueError("fp16 training needs a grad scaler (dynamic or --loss-scale)")
        self.grad_scaler = grad_scaler
        self.float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.Tensor]] = []

        for group in optimizer.param_groups:
            half_params, master_params, fp32_params = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in _HALF_DTYPES:
                    master = param.detach().clone().float()
                    for attr in _PARALLEL_ATTRS:
                        if hasattr(param, attr):
                            setattr(master, attr, getattr(param, attr))
                    group["params"][i] = master
                    if param in optimizer.state:
                        optimizer.state[master] = optimizer.state.pop(param)
                    half_params.append(param)
                    master_params.append(master)
                elif param.dtype == torch.float32:
                    fp32_params.append(param)
                else:
                    raise ValueError(
                        f"unsupported param dtype {param.dtype}: the mixed-precision optimizer "
                        "handles float16, bfloat16 and float32 params"
                    )
            self.float16_groups.append(half_params)
            self.fp32_from_float16_groups.append(master_params)
            self.fp32_from_fp32_groups.append(fp32_params)

        super().__init__(optimizer, config, model_parallel_group, tp_rank)
        self._scale_one = torch.tensor([1.0], dtype=torch.float32, device=self._device)
        self.found_inf = torch.tensor([0.0], dtype=torch.float32, device=self._device)

    # ------------------------------------------------------------------ precision plumbing
    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        for groups in (
            self.float16_groups,
            self.fp32_from_float16_groups,
            self.fp32_from_fp32_groups,
        ):
            for group in groups:
                _zero_grad_group(group, set_to_none)

    def _copy_model_grads_to_main_grads(self) -> None:
        masters = [m for group in self.fp32_from_float16_groups for m in group]
        halves = [h for group in self.float16_groups for h in group]
        grads = as_float32([_model_grad(h) for h in halves], self._foreach)
        for half_param, master, grad in zip(halves, masters, grads):
            master.grad = grad
            # The model's own .grad is no longer needed (main_grad, if any, is DDP's buffer).
            half_param.grad = None
        fp32_params = [
            p
            for group in self.fp32_from_fp32_groups
            for p in group
            if getattr(p, "main_grad", None) is not None
        ]
        grads = as_float32([p.main_grad for p in fp32_params], self._foreach)
        for param, grad in zip(fp32_params, grads):
            param.grad = grad

    def _main_grads(self) -> List[torch.Tensor]:
        return [
            p.grad
            for groups in (self.fp32_from_float16_groups, self.fp32_from_fp32_groups)
            for group in groups
            for p in group
            if p.grad is not None
        ]

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        grads = self._main_grads()
        self.found_inf.fill_(0.0)
        inv_scale = self.grad_scaler.inv_scale.to(self.found_inf.device)
        same_device = all(g.device == self.found_inf.device for g in grads)
        if grads and same_device:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inv_scale)
        else:
            for grad in grads:
                if not torch.isfinite(grad).all():
                    self.found_inf.fill_(1.0)
                grad.mul_(inv_scale.to(grad.device))
        if dist.is_available() and dist.is_initialized():
            for group in (self.model_parallel_group, self.expert_parallel_group):
                if group is not None:
                    dist.all_reduce(self.found_inf, op=dist.ReduceOp.MAX, group=group)
        return bool(self.found_inf.item() > 0)

    def _halves_and_masters(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        halves = [h for group in self.float16_groups for h in group]
        masters = [m for group in self.fp32_from_float16_groups for m in group]
        return halves, masters

    def _copy_main_params_to_model_params(self) -> None:
        halves, masters = self._halves_and_masters()
        copy_tensors(halves, masters, self._foreach)

    def reload_model_params(self) -> None:
        halves, masters = self._halves_and_masters()
        copy_tensors(masters, halves, self._foreach)

    def main_param_copies(self) -> Dict[torch.Tensor, MainParamCopy]:
        return {
            half: MainParamCopy(master)
            for half_group, master_group in zip(self.float16_groups, self.fp32_from_float16_groups)
            for half, master in zip(half_group, master_group)
        }

    # ------------------------------------------------------------------ step
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        return self._step_on_main_params()

    def _release_grads(self) -> None:
        # fp32 model params got .grad = main_grad (DDP's buffer); drop the alias, as FP32Optimizer
        # does, so a later backward cannot accumulate into the buffer twice.
        for group in self.fp32_from_fp32_groups:
            for param in group:
                if getattr(param, "main_grad", None) is not None:
                    param.grad = None

    # ------------------------------------------------------------------ checkpointing
    def model_param_groups(self) -> List[List[torch.Tensor]]:
        model_param_of = {
            id(master): half
            for half_group, master_group in zip(self.float16_groups, self.fp32_from_float16_groups)
            for half, master in zip(half_group, master_group)
        }
        return [
            [model_param_of.get(id(p), p) for p in group["params"]]
            for group in self.optimizer.param_groups
        ]

    def state_dict(self) -> Dict[str, Any]:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        state["fp32_from_fp16_params"] = [
            [master.detach() for master in group] for group in self.fp32_from_float16_groups
        ]
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        inner_key = "optimizer" if "optimizer" in state_dict else "optimizer_state_dict"
        if inner_key not in state_dict:
            raise ValueError(
                "optimizer checkpoint has neither 'optimizer' nor 'optimizer_state_dict'"
            )
        self._load_inner_state_dict(state_dict[inner_key])

        if "grad_scaler" in state_dict:
            if self.grad_scaler is not None:
                self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        elif self.config.fp16:
            print(
                "WARNING: the optimizer checkpoint has no grad scaler state; "
                "keeping the initial loss scale",
                flush=True,
            )

        masters_key = (
            "fp32_from_fp16_params" if "fp32_from_fp16_params" in state_dict else "fp32_from_fp16"
        )
        if masters_key not in state_dict:
            raise ValueError(
                "optimizer checkpoint has no fp32 master params ('fp32_from_fp16_params')"
            )
        saved_groups = state_dict[masters_key]
        if len(saved_groups) != len(self.fp32_from_float16_groups):
            raise ValueError(
                f"optimizer checkpoint has {len(saved_groups)} master param groups, "
                f"this model has {len(self.fp32_from_float16_groups)}"
            )
        for g, (current_group, saved_group) in enumerate(
            zip(self.fp32_from_float16_groups, saved_groups)
        ):
            if len(saved_group) != len(current_group):
                raise ValueError(
                    f"optimizer checkpoint master param group {g} has {len(saved_group)} params, "
                    f"this model has {len(current_group)}"
                )
            for i, (current, saved) in enumerate(zip(current_group, saved_group)):
                if tuple(saved.shape) != tuple(current.shape):
                    raise ValueError(
                        f"optimizer checkpoint master param {i} of group {g} has shape "
                        f"{tuple(saved.shape)}, this model has {tuple(current.shape)}"
                    )
                current.copy_(saved)
