"""Distributed optimizer (ZeRO-1): each DP rank keeps fp32 main params and optimizer state only for
its contiguous 1/DP slice of every gradient bucket.

One step: the DDP wrapper has reduce-scattered the gradients (each rank holds the reduced
gradient of its slice); the slice's gradient is unscaled and checked for inf/NaN (fp16), its norm
is summed over DP and the model-parallel group and clipped; the inner torch optimizer updates the
slice's main params; the slice is copied into the model's flat param buffer (rounded to bf16/fp16
when the model is half precision) and the DDP wrapper all-gathers the slices so that every rank
again holds all params (with --overlap-param-gather: launched here, waited for by the next
forward, bucket by bucket).

For fp32 model params the "main param" is a view of the model param's slice: no copy is kept.

Experts (MoE): the DDP wrapper keeps the expert parameters (``allreduce = False``) in buffers of
their own, reduced over the expert-data-parallel group; their slices are owned per rank of that
group, as Megatron's separate expert optimizer does. Norms, zero counts and the inf/NaN flag sum
the dense slices over DP and the model-parallel group and the expert slices over expert DP and
the expert-tensor x expert x pipeline group (``expert_parallel_group``, set by the trainer).

Checkpoints (Megatron's torch format): :meth:`state_dict` holds the param groups (with the step
count) and the grad scaler, without per-param state; the per-param state lives in
``distrib_optim.pt``: :meth:`get_parameter_state_dp_zero` gathers, per buffer and bucket, the flat
fp32 ``param``, ``exp_avg`` and ``exp_avg_sq`` (without the bucket's end padding, which depends on
DP) on DP rank 0; :meth:`load_parameter_state_from_dp_zero` re-shards it for the current DP size.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.distributed.param_and_grad_buffer import buffer_layout
from megatron.core.tensor_parallel import collectives

from .clip_grads import param_is_counted_once, sum_of_powered_norms
from .grad_scaler import MegatronGradScaler
from .optimizer import (
    _PARALLEL_ATTRS,
    MainParamCopy,
    MegatronOptimizer,
    as_float32,
    copy_tensors,
    place_step_tensors,
)
from .optimizer_config import OptimizerConfig

_FILE_ERROR = "error"
"""Key of the message that :meth:`DistributedOptimizer._state_from_file` leaves for the load."""
_STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


class _ShardRange:
    """The part of one model param that this rank owns."""

    def __init__(self, model_param, bucket, param_start: int, param_end: int, buffer_start: int):
        self.model_param = model_param
        self.bucket = bucket
        self.param_start = param_start
        """[param_start, param_end): range in the flattened param."""
        self.param_end = param_end
        self.buffer_start = buffer_start
        """Where the range starts in the flat buffer."""

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start

    def grad(self) -> torch.Tensor:
        # This rank's slice of the bucket: a view of the full buffer, or with sharded gradients
        # (ZeRO-2) of the kept slices.
        own_start = self.bucket.offset + self.bucket.shard_range(self.bucket.buffer.dp_rank)[0]
        start = self.buffer_start - own_start
        return self.bucket.local_grad_shard()[start : start + self.numel]

    def model_slice(self) -> torch.Tensor:
        return self.model_param.detach().view(-1)[self.param_start : self.param_end]


class DistributedOptimizer(MegatronOptimizer):
    """Sharded main params and optimizer state over the data-parallel group of the DDP chunks."""

    def __init__(
        self,
        optimizer_cls,
        optimizer_kwargs: Dict[str, Any],
        param_groups: List[Dict[str, Any]],
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        model_chunks: Sequence[torch.nn.Module],
        model_parallel_group=None,
        tp_rank: int = 0,
    ):
        if config.fp16 and grad_scaler is None:
            raise ValueError("fp16 training needs a grad scaler (dynamic or --loss-scale)")
        for chunk in model_chunks:
            ddp_config = getattr(chunk, "ddp_config", None)
            if not hasattr(chunk, "buffers") or not getattr(
                ddp_config, "use_distributed_optimizer", False
            ):
                raise ValueError(
                    "--use-distributed-optimizer needs the model chunks wrapped in "
                    "DistributedDataParallel built with use_distributed_optimizer=True"
                )
        self.model_chunks = list(model_chunks)
        self.grad_scaler = grad_scaler
        self.optimizer_name = "adam" if issubclass(optimizer_cls, torch.optim.AdamW) else "sgd"
        # With several distributed-optimizer instances the state is sharded over the DP ranks of
        # this rank's instance only (and replicated across instances).
        first = self.model_chunks[0]
        self.data_parallel_group = getattr(first, "intra_dp_cp_group", first.data_parallel_group)
        self.dp_size = collectives.group_size(self.data_parallel_group)
        self.dp_rank = collectives.group_rank(self.data_parallel_group)
        self.instance_rank = collectives.group_rank(getattr(first, "inter_dist_opt_group", None))
        """This rank's distributed-optimizer instance (0 with one): the state roots of instance
        0 write checkpoints, every instance's roots read them."""
        # All (chunk, buffer) pairs in order: Megatron's gbuf index. The dense buffers come first,
        # then the expert ones (Megatron's two chained optimizers, dense then expert).
        dense = [buffer for chunk in self.model_chunks for buffer in chunk.buffers]
        expert = [
            buffer
            for chunk in self.model_chunks
            for buffer in getattr(chunk, "expert_parallel_buffers", [])
        ]
        self.buffers = dense + expert
        self.num_dense_buffers = len(dense)
        """``buffers[:num_dense_buffers]`` are sharded over the data-parallel group, the rest
        (expert parameters) over the expert-data-parallel group (each buffer's ``dp_group``)."""

        # Which slice of which param this rank owns.
        self.shard_ranges: Dict[torch.nn.Parameter, _ShardRange] = {}
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                own_start, own_end = bucket.shard_range(buffer.dp_rank)
                own_start += bucket.offset
                own_end += bucket.offset
                for param in bucket.params:
                    p_start, p_end, _ = buffer.param_index_map[param]
                    lo, hi = max(p_start, own_start), min(p_end, own_end)
                    if lo < hi:
                        self.shard_ranges[param] = _ShardRange(
                            param, bucket, lo - p_start, hi - p_start, lo
                        )

        # Main params: fp32 clones of owned slices of half params, views of fp32 params' slices.
        self.main_params: Dict[torch.nn.Parameter, torch.Tensor] = {}
        self.model_params_of_group: List[List[torch.nn.Parameter]] = []
        groups = []
        for group in param_groups:
            owned = [p for p in group["params"] if p in self.shard_ranges]
            mains = []
            for p in owned:
                rng = self.shard_ranges[p]
                if p.dtype == torch.float32:
                    main = rng.model_slice()
                elif p.dtype in (torch.float16, torch.bfloat16):
                    main = rng.model_slice().clone().float()
                else:
                    raise ValueError(
                        f"unsupported param dtype {p.dtype} for the distributed optimizer"
                    )
                for attr in _PARALLEL_ATTRS:
                    if hasattr(p, attr):
                        setattr(main, attr, getattr(p, attr))
                self.main_params[p] = main
                mains.append(main)
            self.model_params_of_group.append(owned)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": mains})
        inner = optimizer_cls(groups, **optimizer_kwargs)
        self.num_inner_steps = 0
        super().__init__(inner, config, model_parallel_group, tp_rank)
        device = self.buffers[0].grad_data.device if self.buffers else self._device
        self._device = device
        self._scale_one = torch.tensor([1.0], dtype=torch.float32, device=device)
        self.found_inf = torch.tensor([0.0], dtype=torch.float32, device=device)

    # ------------------------------------------------------------------ collectives over DP + MP
    def _reduce_groups(self, expert: bool = False):
        """The groups over which a per-rank sum of the dense (or expert) shards becomes the
        total: the (expert-)data-parallel group that shards them, then the ranks holding other
        parts of the model (the model-parallel group, or for experts the expert-tensor x expert
        x pipeline group)."""
        if expert:
            shard_group = self.buffers[-1].dp_group if self._has_expert_buffers() else None
            others = self.expert_parallel_group
        else:
            shard_group = self.data_parallel_group
            others = self.model_parallel_group
        return [
            group
            for group in (shard_group, others)
            if group is not None and collectives.group_size(group) > 1
        ]

    def _has_expert_buffers(self) -> bool:
        return len(self.buffers) > self.num_dense_buffers

    def _reduces_expert_part(self) -> bool:
        """Whether this rank joins the expert reductions: it holds expert shards, or the model
        has experts on another pipeline stage (the trainer then sets expert_parallel_group on
        every rank)."""
        return self._has_expert_buffers() or self.expert_parallel_group is not None

    def _all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, expert=False) -> torch.Tensor:
        for group in self._reduce_groups(expert):
            dist.all_reduce(tensor, op=op, group=group)
        return tensor

    def _sum_dense_and_expert(self, dense: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Sum per-rank partial sums of the dense and of the expert shards over every rank."""
        self._all_reduce(dense)
        if self._reduces_expert_part():
            self._all_reduce(expert, expert=True)
            return dense + expert
        return dense

    # ------------------------------------------------------------------ grads
    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        for main in self.main_params.values():
            main.grad = None

    def main_param_copies(self) -> Dict[torch.Tensor, MainParamCopy]:
        """Every half-precision param of the buffers: this rank's fp32 slice of it (if any),
        sharded over the buffer's (expert-)data-parallel group."""
        return {
            param: MainParamCopy(self.main_params.get(param), buffer.dp_group)
            for buffer in self.buffers
            for param in buffer.param_index_map
            if param.dtype in (torch.float16, torch.bfloat16)
        }

    def _main_params_in_order(self) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
        return [
            (p, m)
            for owned in self.model_params_of_group
            for p in owned
            for m in (self.main_params[p],)
        ]

    def _copy_model_grads_to_main_grads(self) -> None:
        pairs = self._main_params_in_order()
        grads = [self.shard_ranges[param].grad() for param, _ in pairs]
        for (_, main), grad in zip(pairs, as_float32(grads, self._foreach)):
            main.grad = grad

    def _main_grads(self) -> List[torch.Tensor]:
        return [m.grad for _, m in self._main_params_in_order() if m.grad is not None]

    def _counted_grads(self, expert: Optional[bool]) -> List[torch.Tensor]:
        """The main grads this rank counts in norms and zero counts (all, dense or expert): a
        param not split over (expert-)tensor parallelism is counted on its rank 0 only."""
        out = []
        for p, m in self._main_params_in_order():
            if m.grad is None:
                continue
            is_expert = not getattr(p, "allreduce", True)
            if expert is not None and is_expert != expert:
                continue
            if param_is_counted_once(p, self.expert_tp_rank if is_expert else self.tp_rank):
                out.append(m.grad)
        return out

    def get_main_grads_for_grad_norm(self, expert: Optional[bool] = None) -> List[torch.Tensor]:
        return self._counted_grads(expert)

    def get_grad_norm(self) -> float:
        def sum_of_squares(grads):
            return sum_of_powered_norms(grads, 2.0, self._device, self._foreach).reshape(1)

        dense = sum_of_squares(self._counted_grads(False))
        expert = sum_of_squares(self._counted_grads(True))
        return float(self._sum_dense_and_expert(dense, expert).item()) ** 0.5

    def clip_grad_norm(self, clip_grad: float) -> float:
        grad_norm = self.get_grad_norm()
        coeff = float(clip_grad) / (grad_norm + 1.0e-6)
        grads = self._main_grads()
        if coeff < 1.0 and grads:
            torch._foreach_mul_(grads, coeff)
        return grad_norm

    def count_zeros(self) -> int:
        def zeros(grads):
            total = torch.zeros(1, dtype=torch.float64, device=self._device)
            for grad in grads:
                total += grad.numel() - torch.count_nonzero(grad)
            return total

        total = self._sum_dense_and_expert(
            zeros(self._counted_grads(False)), zeros(self._counted_grads(True))
        )
        return int(total.item())

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        grads = self._main_grads()
        self.found_inf.fill_(0.0)
        inv_scale = self.grad_scaler.inv_scale.to(self.found_inf.device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inv_scale)
        # Dense then expert groups: together they reach every rank.
        self._all_reduce(self.found_inf, op=dist.ReduceOp.MAX)
        if self._reduces_expert_part():
            self._all_reduce(self.found_inf, op=dist.ReduceOp.MAX, expert=True)
        return bool(self.found_inf.item() > 0)

    # ------------------------------------------------------------------ step
    def _half_slices_and_mains(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """This rank's slices of the half-precision model params and their fp32 main copies
        (an fp32 param's main param is its slice: nothing to copy)."""
        pairs = [(p, m) for p, m in self._main_params_in_order() if p.dtype != torch.float32]
        return [self.shard_ranges[p].model_slice() for p, _ in pairs], [m for _, m in pairs]

    def _copy_main_params_to_model_params(self) -> None:
        slices, mains = self._half_slices_and_mains()
        copy_tensors(slices, mains, self._foreach)

    def reload_model_params(self) -> None:
        """Refresh the fp32 main slices from the (freshly loaded) model params."""
        self._finish_param_gathers()
        slices, mains = self._half_slices_and_mains()
        copy_tensors(mains, slices, self._foreach)

    def _gather_model_params(self, force_sync: bool = False) -> None:
        """All-gather the updated slices; with --overlap-param-gather (and not ``force_sync``)
        the gathers are only launched and the next forward waits for them bucket by bucket."""
        timer = self._start("params-all-gather")
        for chunk in self.model_chunks:
            chunk.start_param_sync(force_sync=force_sync)
        timer.stop()

    def _finish_param_gathers(self) -> None:
        for chunk in self.model_chunks:
            chunk.finish_param_sync()

    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        # A forward normally waited for last step's gathers; never write a slice still being
        # gathered.
        self._finish_param_gathers()
        return self._step_on_main_params()

    def _after_main_params_copied(self) -> None:
        self.num_inner_steps += 1
        self._gather_model_params()

    def _release_grads(self) -> None:
        self.zero_grad()

    # ------------------------------------------------------------------ memory accounting
    def optimizer_state_bytes(self) -> int:
        """Bytes this rank holds for fp32 main params (copies only) and optimizer state."""
        total = 0
        for param, main in self._main_params_in_order():
            if param.dtype != torch.float32:
                total += main.numel() * main.element_size()
            for value in self.optimizer.state.get(main, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total

    # ------------------------------------------------------------ checkpointing: model_optim_rng.pt
    def state_dict(self) -> Dict[str, Any]:
        inner = self.optimizer.state_dict()
        groups = []
        for group in inner["param_groups"]:
            group = {k: v for k, v in group.items() if k != "params"}
            group["step"] = self.num_inner_steps
            groups.append(group)
        state = {"optimizer": {"param_groups": groups}}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        saved = state_dict.get("optimizer", {}).get("param_groups")
        if saved is None:
            raise ValueError(
                "distributed optimizer checkpoint has no 'optimizer'/'param_groups' entry "
                "(was it saved without --use-distributed-optimizer?)"
            )
        if len(saved) != len(self.optimizer.param_groups):
            raise ValueError(
                f"optimizer checkpoint has {len(saved)} param groups, this model has "
                f"{len(self.optimizer.param_groups)}"
            )
        keep = (
            "params",
            "wd_mult",
            "lr_mult",
            "is_decoupled_lr",
            "is_expert_parallel",
            "max_lr",
            "min_lr",
        )
        for group, saved_group in zip(self.optimizer.param_groups, saved):
            for key, value in saved_group.items():
                # "fused"/"foreach": how this run steps (optimizer_step_impl), not state.
                if key not in keep and key not in ("step", "fused", "foreach"):
                    group[key] = value
        self.num_inner_steps = int(saved[0].get("step", 0)) if saved else 0
        for main in self.main_params.values():
            if "step" in self.optimizer.state.get(main, {}):
                self.optimizer.state[main]["step"] = torch.tensor(
                    float(self.num_inner_steps),
                    device="cpu",  # host: where non-fused torch.optim keeps it; moved below
                )
        place_step_tensors(self.optimizer)
        if "grad_scaler" in state_dict and self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    # -------------------------------------------------------------- checkpointing: distrib_optim.pt
    def _state_keys(self) -> Tuple[str, ...]:
        return ("param",) + _STATE_KEYS[self.optimizer_name]

    def _local_shard(self, bucket, key: str) -> torch.Tensor:
        """This rank's slice of ``bucket`` for one state key (fp32, zeros in padding)."""
        shard = torch.zeros(
            bucket.shard_size, dtype=torch.float32, device=bucket.buffer.grad_data.device
        )
        own_start = bucket.offset + bucket.shard_range(bucket.buffer.dp_rank)[0]
        for param in bucket.params:
            rng = self.shard_ranges.get(param)
            if rng is None:
                continue
            main = self.main_params[param]
            value = main if key == "param" else self.optimizer.state.get(main, {}).get(key)
            if value is None:
                continue
            start = rng.buffer_start - own_start
            shard[start : start + rng.numel].copy_(value.detach().view(-1))
        return shard

    def is_state_root(self, gbuf_idx: int) -> bool:
        """Whether this rank gathers (and reads) the state of buffer ``gbuf_idx``: rank 0 of the
        group that shards it (data-parallel, or expert-data-parallel for experts)."""
        return self.buffers[gbuf_idx].dp_rank == 0

    def get_parameter_state_dp_zero(self) -> Optional[Dict[Any, Any]]:
        """Gather the per-param state of each buffer to rank 0 of the group that shards it (a
        collective over DP, and over expert DP for expert buffers: call it on every rank).

        Returns ``{gbuf_idx: {(param_dtype, grad_dtype): {key: [flat fp32 tensor per bucket,
        without end padding]}}, 'per_bucket_numel': ..., 'per_bucket_numel_unpadded': ...}``
        with keys ``param``, ``exp_avg``, ``exp_avg_sq`` (adam), holding the buffers this rank is
        the root of (:meth:`is_state_root`); None when it is the root of none.
        """
        state: Dict[Any, Any] = {
            "per_bucket_numel": [
                {(b.param_dtype, b.grad_dtype): [k.numel for k in b.buckets]} for b in self.buffers
            ],
            "per_bucket_numel_unpadded": [
                {(b.param_dtype, b.grad_dtype): [k.numel_unpadded for k in b.buckets]}
                for b in self.buffers
            ],
        }
        for gbuf_idx, buffer in enumerate(self.buffers):
            tensors: Dict[str, List[torch.Tensor]] = {key: [] for key in self._state_keys()}
            for bucket in buffer.buckets:
                for key in self._state_keys():
                    shard = self._local_shard(bucket, key)
                    full = torch.empty(bucket.numel, dtype=torch.float32, device=shard.device)
                    collectives.all_gather_into_tensor(full, shard, buffer.dp_group)
                    if self.is_state_root(gbuf_idx):
                        tensors[key].append(full[: bucket.numel_unpadded].cpu())
            if self.is_state_root(gbuf_idx):
                state[gbuf_idx] = {(buffer.param_dtype, buffer.grad_dtype): tensors}
        roots = any(self.is_state_root(i) for i in range(len(self.buffers)))
        return state if roots else None

    @torch.no_grad()
    def load_parameter_state_from_dp_zero(self, state: Optional[Dict[Any, Any]]) -> None:
        """Load what :meth:`get_parameter_state_dp_zero` returned (needed for the buffers this
        rank is the root of; a collective over DP and expert DP), re-sharded for this run."""
        for gbuf_idx, buffer in enumerate(self.buffers):
            dtype_key = (buffer.param_dtype, buffer.grad_dtype)
            group = buffer.dp_group
            for b, bucket in enumerate(buffer.buckets):
                for key in self._state_keys():
                    full = torch.zeros(
                        bucket.numel, dtype=torch.float32, device=bucket.buffer.grad_data.device
                    )
                    problem = torch.zeros(1, dtype=torch.float32, device=full.device)
                    message = ""
                    if self.is_state_root(gbuf_idx):
                        try:
                            if isinstance(state, dict) and _FILE_ERROR in state:
                                raise ValueError(state[_FILE_ERROR])
                            saved = state[gbuf_idx][dtype_key][key][b]
                            if saved.numel() != bucket.numel_unpadded:
                                raise ValueError(
                                    f"bucket {b} of buffer {gbuf_idx} holds {saved.numel()} "
                                    f"elements, this model's has {bucket.numel_unpadded}"
                                )
                            full[: bucket.numel_unpadded].copy_(saved)
                        except (KeyError, IndexError, TypeError, ValueError) as exc:
                            problem.fill_(1.0)
                            message = f"{type(exc).__name__}: {exc}"
                    if buffer.dp_size > 1:
                        dist.all_reduce(problem, op=dist.ReduceOp.MAX, group=group)
                    if problem.item() > 0:
                        raise ValueError(
                            "distrib_optim.pt does not match this model's buffers/buckets "
                            f"(state key {key!r}) {message}".rstrip()
                        )
                    collectives.broadcast(full, 0, group)
                    for param in bucket.params:
                        rng = self.shard_ranges.get(param)
                        if rng is None:
                            continue
                        start = rng.buffer_start - bucket.offset
                        values = full[start : start + rng.numel]
                        main = self.main_params[param]
                        if key == "param":
                            main.view(-1).copy_(values)
                        else:
                            st = self.optimizer.state.setdefault(main, {})
                            st[key] = values.clone().view_as(main)
                            step = torch.tensor(
                                float(self.num_inner_steps),
                                device="cpu",  # host: where torch.optim keeps it
                            )
                            st.setdefault("step", step)
        place_step_tensors(self.optimizer)
        self._copy_main_params_to_model_params()
        self._gather_model_params(force_sync=True)

    # Megatron's distrib_optim.pt: without experts, the dict of get_parameter_state_dp_zero; with
    # experts (Megatron chains a dense and an expert optimizer), a list of two such dicts, dense
    # then expert, each numbering its own buffers from 0, None where this rank roots none.
    def _parts(self) -> List[range]:
        dense = range(0, self.num_dense_buffers)
        if not self._has_expert_buffers():
            return [dense]
        return [dense, range(self.num_dense_buffers, len(self.buffers))]

    def parameter_state_for_file(self) -> Optional[Any]:
        """What this rank writes to ``distrib_optim.pt`` (None: nothing); a collective."""
        state = self.get_parameter_state_dp_zero()
        if self.instance_rank != 0:  # the same state as instance 0's, which writes it
            return None
        if not self._has_expert_buffers():
            return state
        if state is None:
            return None
        out = []
        for part in self._parts():
            if not any(i in state for i in part):
                out.append(None)
                continue
            sub = {
                name: [state[name][i] for i in part]
                for name in ("per_bucket_numel", "per_bucket_numel_unpadded")
            }
            for local, i in enumerate(part):
                sub[local] = state[i]
            out.append(sub)
        return out

    def _state_from_file(self, saved: Any) -> Dict[Any, Any]:
        """The inverse of :meth:`parameter_state_for_file` (global buffer indices)."""
        if not self._has_expert_buffers():
            return saved
        parts = self._parts()
        if not isinstance(saved, list) or len(saved) != len(parts):
            # Reported by load_parameter_state_from_dp_zero, on every rank of the group.
            return {
                _FILE_ERROR: "a model with experts keeps a list of the dense and the expert "
                f"optimizer's state there, the file holds a {type(saved).__name__}"
            }
        state: Dict[Any, Any] = {}
        for part, sub in zip(parts, saved):
            for local, i in enumerate(part):
                if isinstance(sub, dict) and local in sub:
                    state[i] = sub[local]
        return state

    def holds_any_state_root(self) -> bool:
        """Whether this rank reads ``distrib_optim.pt`` when loading."""
        return any(self.is_state_root(i) for i in range(len(self.buffers)))

    def save_parameter_state(self, filename: str) -> None:
        """Gather the parameter state and write it to ``filename`` on the ranks that root it."""
        state = self.parameter_state_for_file()
        if state is not None:
            torch.save(state, filename)

    def load_parameter_state(
        self, filename: str, legacy_rank: Optional[Dict[int, int]] = None
    ) -> None:
        """Read ``filename`` on the ranks that root a buffer and re-shard it over (expert) DP.

        ``legacy_rank`` (id(param) -> rank in this code base's earlier registration order, see
        param_order.py): the file was written with the buffers laid out in that order; its
        state is moved to the current layout first."""
        state = None
        if self.holds_any_state_root():
            saved = torch.load(filename, map_location="cpu", weights_only=True)
            state = self._state_from_file(saved)
            if legacy_rank is not None and _FILE_ERROR not in state:
                state = self._state_in_current_layout(state, legacy_rank)
        self.load_parameter_state_from_dp_zero(state)

    def _state_in_current_layout(
        self, state: Dict[Any, Any], legacy_rank: Dict[int, int]
    ) -> Dict[Any, Any]:
        """The per-bucket state of buffers laid out in the legacy parameter order (buffers take
        parameters in reverse registration order in both layouts; the registration order is what
        differs), moved param by param into the current layout; a state that does not fit the
        legacy layout is left for the load to refuse."""
        moved = dict(state)
        for gbuf_idx, buffer in enumerate(self.buffers):
            dtype_key = (buffer.param_dtype, buffer.grad_dtype)
            try:
                saved = state[gbuf_idx][dtype_key]
            except (KeyError, TypeError):
                continue
            old_params = sorted(buffer.params, key=lambda p: -legacy_rank[id(p)])
            starts, bounds = buffer_layout(
                old_params, buffer.bucket_size, buffer.use_distributed_optimizer, buffer.dp_size
            )
            if [b[3] - b[2] for b in bounds] != [len(t) for t in saved.get("param", [])]:
                continue
            old_place = {}
            for b, (first, last, bucket_start, _, _) in enumerate(bounds):
                for i in range(first, last):
                    old_place[id(old_params[i])] = (b, starts[i] - bucket_start)
            tensors = {}
            for key, old_buckets in saved.items():
                new_buckets = []
                for bucket in buffer.buckets:
                    flat = torch.zeros(
                        bucket.numel_unpadded,
                        dtype=torch.float32,
                        device="cpu",  # host: staging for loaded values
                    )
                    for param in bucket.params:
                        start = buffer.param_index_map[param][0] - bucket.offset
                        b, old_start = old_place[id(param)]
                        n = param.numel()
                        flat[start : start + n].copy_(old_buckets[b][old_start : old_start + n])
                    new_buckets.append(flat)
                tensors[key] = new_buckets
            moved[gbuf_idx] = {dtype_key: tensors}
        return moved
