"""Forward/backward schedules over the micro-batches of one iteration.

* :func:`forward_backward_no_pipelining` (PP = 1),
* :func:`forward_backward_pipelining_without_interleaving` (1F1B: warm-up forwards, steady
  one-forward-one-backward, cool-down backwards),
* :func:`forward_backward_pipelining_with_interleaving` (several model chunks per rank),

chosen by :func:`get_forward_backward_func`. What the trainer adds to the model (the fp16 loss
scaler, the gradient finalization, timers, per-token loss, the interleaving group size, the
overlapped gradient sync and, for tests, a callback per compute) arrives as a
:class:`~megatron.core.pipeline_parallel.step_context.StepContext` (``step_context=``); without
one the schedules read it from the model config, where Megatron Core's callers set it.
The schedule talks to the model only through its methods: ``set_input_tensor`` and, for MoE
models, ``set_moe_aux_loss_scale``.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.device import compute_device
from megatron.core.pipeline_parallel.layer_split import check_interleaved_microbatches
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, get_tensor_shape
from megatron.core.pipeline_parallel.step_context import StepContext
from megatron.core.utils import get_model_config, unwrap_model


def get_forward_backward_func(
    pp_size: Optional[int] = None, vp_size: Optional[int] = None
) -> Callable:
    """The schedule for a layout: no pipelining, 1F1B, or interleaved 1F1B (virtual stages).

    Megatron-core's signature: sizes left None come from the current ``parallel_state`` (a
    single stage without one)."""
    state = parallel_state.current_parallel_state()
    if pp_size is None:
        pp_size = state.get_pipeline_model_parallel_world_size() if state is not None else 1
    if vp_size is None and state is not None:
        vp_size = state.layout.virtual_pipeline_model_parallel_size
    if pp_size > 1:
        if vp_size is not None and vp_size > 1:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    if vp_size is not None and vp_size > 1:
        raise ValueError(
            "virtual pipeline stages (--num-layers-per-virtual-pipeline-stage / "
            "--num-virtual-stages-per-pipeline-rank) need --pipeline-model-parallel-size > 1"
        )
    return forward_backward_no_pipelining


def _no_adjusted_shapes(adjust_tensor_shapes_fn: Optional[Callable], schedule: str) -> None:
    if adjust_tensor_shapes_fn is not None:
        raise ValueError(f"adjust_tensor_shapes_fn is not supported by the {schedule} schedule")


def _adjusted_shape(adjust_tensor_shapes_fn: Optional[Callable], tensor_shape):
    """The one shape both directions use after ``adjust_tensor_shapes_fn(recv, send)``
    (megatron-core's hook, given and returning lists of shapes)."""
    if adjust_tensor_shapes_fn is None:
        return tensor_shape
    recv, send = adjust_tensor_shapes_fn([tensor_shape], [tensor_shape])
    shapes = {tuple(shape) for shape in list(recv) + list(send)}
    if len(shapes) != 1:
        raise ValueError(
            "adjust_tensor_shapes_fn: this 1F1B schedule sends and receives one tensor of one "
            f"shape, got shapes {sorted(shapes)}"
        )
    return tuple(shapes.pop())


def _resolve_context(step_context: Optional[StepContext], config) -> StepContext:
    return step_context if step_context is not None else StepContext.from_config(config)


def _finalize_grads(ctx: StepContext, model_chunks, total_tokens: torch.Tensor) -> None:
    """Hand the gradients to ``ctx.finalize_model_grads_func`` once backward is complete."""
    if ctx.finalize_model_grads_func is not None:
        per_token = ctx.calculate_per_token_loss
        ctx.finalize_model_grads_func(model_chunks, num_tokens=total_tokens if per_token else None)


def forward_step(
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    config,
    ctx: StepContext,
    forward_data_store: list,
    forward_only: bool,
    collect_non_loss_data: bool = False,
    *,
    input_tensor: Optional[torch.Tensor] = None,
    set_input_tensor: bool = False,
    is_last_stage: bool = True,
):
    """Run one micro-batch forward and turn its loss into the tensor that backward starts from.

    Pipeline schedules pass ``set_input_tensor=True`` with the activation received from the
    previous stage (None on the first stage); only the last stage (``is_last_stage``) applies the
    loss function, other stages return their hidden states.

    A loss function may return ``(loss_sum, num_tokens, reported)`` (per-token averaging) or the
    legacy ``(loss, reported)``. Unless ``ctx.calculate_per_token_loss``, the loss is divided by
    its token count and by the number of micro-batches, so gradients are the mean over
    micro-batches. ``config`` is the model's (context parallelism, MoE). Returns
    ``(output_tensor, num_tokens)``.
    """
    timer = ctx.timer("forward-compute")
    if timer:
        timer.start()
    cp_size = config.context_parallel_size
    if set_input_tensor:
        unwrap_model(model).set_input_tensor(input_tensor)
    if getattr(config, "num_moe_experts", None):
        # On the chunk being run: under virtual stages each chunk's routers get theirs in turn.
        unwrap_model(model).set_moe_aux_loss_scale(
            ctx.moe_aux_loss_scale(
                num_microbatches, cp_size, getattr(config, "calculate_per_token_loss", False)
            )
        )
    if getattr(config, "mtp_num_layers", None):
        set_mtp_scale = getattr(unwrap_model(model), "set_mtp_loss_scale", None)
        if set_mtp_scale is not None:
            set_mtp_scale(ctx.mtp_loss_scale(num_microbatches, cp_size))
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    num_tokens = torch.tensor(0, dtype=torch.int, device=compute_device())
    if not is_last_stage:
        if timer:
            timer.stop()
        return output_tensor, num_tokens
    outputs = loss_func(output_tensor)
    if collect_non_loss_data:
        forward_data_store.append(outputs)
    elif len(outputs) == 3:
        output_tensor, num_tokens, reported = outputs
        if not ctx.calculate_per_token_loss:
            output_tensor = output_tensor / num_tokens
            output_tensor = output_tensor / num_microbatches
            # DDP averages gradients over DP x CP; CP ranks each hold part of one sequence, so
            # their contributions must add up: the loss function divides by the token count of the
            # whole sequence (all CP ranks), and the factor cp_size undoes DDP's averaging over CP.
            output_tensor = output_tensor * cp_size
        forward_data_store.append(reported)
    elif len(outputs) == 2:
        output_tensor, reported = outputs
        output_tensor = output_tensor * cp_size / num_microbatches
        forward_data_store.append(reported)
    else:
        raise ValueError(f"loss function returned {len(outputs)} values; expected 2 or 3")
    if timer:
        timer.stop()
    return output_tensor, num_tokens


def backward_step(
    output_tensor: torch.Tensor,
    ctx: StepContext,
    input_tensor: Optional[torch.Tensor] = None,
    output_tensor_grad: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Backward from the loss (``output_tensor_grad`` None: last stage, loss scaling applies) or
    from the gradient of this stage's output received from the next stage; returns the gradient
    of ``input_tensor`` (the activation received from the previous stage), if any."""
    timer = ctx.timer("backward-compute")
    if timer:
        timer.start()
    if output_tensor_grad is None:
        if ctx.grad_scale_func is not None:
            output_tensor = ctx.grad_scale_func(output_tensor)
        torch.autograd.backward(output_tensor)
    else:
        torch.autograd.backward(
            output_tensor, grad_tensors=output_tensor_grad.to(output_tensor.dtype)
        )
    input_grad = input_tensor.grad if input_tensor is not None else None
    if timer:
        timer.stop()
    return input_grad


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    step_context: Optional[StepContext] = None,
) -> List[Any]:
    """All micro-batches forward then backward, one at a time; returns the reported losses.

    Gradient synchronisation happens after the last micro-batch, in the step context's
    ``finalize_model_grads_func`` (given the token count for per-token loss scaling).
    """
    _no_adjusted_shapes(adjust_tensor_shapes_fn, "non-pipelined")
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("non-pipeline schedule needs exactly one model chunk")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    config = get_model_config(model)
    ctx = _resolve_context(step_context, config)
    no_sync = getattr(model, "no_sync", nullcontext)
    forward_data_store: List[Any] = []
    total_tokens = torch.tensor(0, dtype=torch.int, device=compute_device())
    with no_sync():
        for _ in range(num_microbatches - 1):
            output, num_tokens = forward_step(
                forward_step_func,
                data_iterator,
                model,
                num_microbatches,
                config,
                ctx,
                forward_data_store,
                forward_only,
                collect_non_loss_data,
            )
            total_tokens += num_tokens
            if not forward_only:
                backward_step(output, ctx)
            # Let go of this micro-batch's graph before the next forward: while it is alive, that
            # forward reuses its AccumulateGrad nodes and the stream they were made on, which
            # breaks a CUDA graph capture in that forward (--cuda-graph-impl local).
            del output
    # The last micro-batch runs outside no_sync so that overlapped reductions could start.
    output, num_tokens = forward_step(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        config,
        ctx,
        forward_data_store,
        forward_only,
        collect_non_loss_data,
    )
    total_tokens += num_tokens
    if not forward_only:
        backward_step(output, ctx)
        _finalize_grads(ctx, [model], total_tokens)
    return forward_data_store


# ---------------------------------------------------------------------------------------- pipelines
@dataclass
class PipelineEvent:
    """One forward ('F') or backward ('B') compute of a pipeline schedule, for tests and tracing."""

    stage: int
    """Pipeline rank."""
    chunk: int
    """Model chunk (virtual stage index on this rank); 0 without interleaving."""
    microbatch: int
    """Micro-batch index within the iteration."""
    kind: str
    """'F' or 'B'."""
    start_ns: int
    """time.monotonic_ns() before the compute (system-wide clock, comparable across processes)."""
    end_ns: int
    """time.monotonic_ns() after the compute."""


def _resolve_communicator(
    config, ctx: StepContext, p2p_communicator, pg_collection
) -> P2PCommunicator:
    if p2p_communicator is not None:
        return p2p_communicator
    if pg_collection is None:
        pg_collection = parallel_state.current_parallel_state()
    if pg_collection is None or not hasattr(pg_collection, "get_pipeline_model_parallel_group"):
        raise ValueError(
            "pipeline schedules need the pipeline group: call initialize_model_parallel(...), "
            "or pass pg_collection=<ParallelState> or "
            "p2p_communicator=P2PCommunicator(pp_group, config)"
        )
    return P2PCommunicator(
        pg_collection.get_pipeline_model_parallel_group(), config, timers=ctx.timers
    )


def _as_list(x, n: int, what: str) -> list:
    if isinstance(x, (list, tuple)):
        if len(x) != n:
            raise ValueError(f"{what}: expected {n} entries (one per model chunk), got {len(x)}")
        return list(x)
    if n != 1:
        raise ValueError(
            f"{what}: the interleaved schedule needs a list with one entry per model chunk ({n})"
        )
    return [x]


def get_schedule_table(
    num_microbatches: int, num_model_chunks: int, group_size: int
) -> List[tuple]:
    """Forward order of (micro-batch, chunk): groups of ``group_size`` micro-batches run through
    chunk 0, then chunk 1, ...; then the next group. The last group holds the remainder."""
    table = []
    for start in range(0, num_microbatches, group_size):
        members = range(start, min(start + group_size, num_microbatches))
        for chunk in range(num_model_chunks):
            table.extend((mb, chunk) for mb in members)
    return table


def _run_pipeline(
    *,
    forward_step_func,
    data_iterators,
    model_chunks,
    num_microbatches,
    config,
    ctx: StepContext,
    communicator: P2PCommunicator,
    tensor_shape,
    table,
    num_warmup,
    forward_only,
    collect_non_loss_data,
) -> List[Any]:
    """Drive one rank through its forward/backward sequence.

    The sequence is warm-up forwards, then (forward k + warm-up, backward k) pairs, then the
    remaining backwards; forward k runs ``table[k]``, backward k runs the same micro-batch on the
    mirrored chunk. Between two computes one batched p2p call carries what the first produced
    (activation to the next stage / input gradient to the previous) and fetches what the second
    needs, so that each rank does one exchange per step; Megatron's schedules also pair each send
    with the receive of the same step (send_forward_recv_backward and the like).
    """
    pp_rank, pp_size = communicator.rank, communicator.world_size
    num_chunks = len(model_chunks)
    total = len(table)
    num_warmup = total if forward_only else min(num_warmup, total)
    steps = [("F", k) for k in range(num_warmup)]
    for i in range(total - num_warmup):
        steps.append(("F", num_warmup + i))
        steps.append(("B", i))
    if not forward_only:
        steps.extend(("B", k) for k in range(total - num_warmup, total))

    def locate(kind, k):
        mb, chunk = table[k]
        return mb, (chunk if kind == "F" else num_chunks - 1 - chunk)

    def first_vstage(chunk):
        return pp_rank == 0 and chunk == 0

    def last_vstage(chunk):
        return pp_rank == pp_size - 1 and chunk == num_chunks - 1

    callback = ctx.pipeline_event_callback
    grad_sync_func = ctx.grad_sync_func
    backwards_left = [num_microbatches] * num_chunks
    input_tensors = [deque() for _ in range(num_chunks)]
    output_tensors = [deque() for _ in range(num_chunks)]
    forward_data_store: List[Any] = []
    total_tokens = torch.tensor(0, dtype=torch.int, device=compute_device())
    send_next = send_prev = None

    with ExitStack() as all_chunks:
        # Gradients are reduced once per chunk, after its last micro-batch: until then no_sync.
        sync_stacks = []
        for chunk in model_chunks:
            stack = ExitStack()
            if not forward_only:
                stack.enter_context(getattr(chunk, "no_sync", nullcontext)())
            sync_stacks.append(stack)
            all_chunks.push(stack.__exit__)
        for kind, k in steps:
            mb, chunk = locate(kind, k)
            recv_prev = kind == "F" and not first_vstage(chunk)
            recv_next = kind == "B" and not last_vstage(chunk)
            from_prev, from_next = communicator.exchange(
                send_next=send_next,
                send_prev=send_prev,
                recv_prev=recv_prev,
                recv_next=recv_next,
                tensor_shape=tensor_shape,
            )
            send_next = send_prev = None
            start = time.monotonic_ns()
            if kind == "F":
                input_tensor = from_prev
                if input_tensor is not None and not forward_only:
                    input_tensor.requires_grad_(True)
                output, num_tokens = forward_step(
                    forward_step_func,
                    data_iterators[chunk],
                    model_chunks[chunk],
                    num_microbatches,
                    config,
                    ctx,
                    forward_data_store,
                    forward_only,
                    collect_non_loss_data,
                    input_tensor=input_tensor,
                    set_input_tensor=True,
                    is_last_stage=last_vstage(chunk),
                )
                total_tokens += num_tokens
                if not last_vstage(chunk):
                    send_next = output
                if not forward_only:
                    input_tensors[chunk].append(input_tensor)
                    output_tensors[chunk].append(output)
            else:
                input_tensor = input_tensors[chunk].popleft()
                output = output_tensors[chunk].popleft()
                backwards_left[chunk] -= 1
                if backwards_left[chunk] == 0:
                    sync_stacks[chunk].close()  # leave no_sync before the chunk's last backward
                input_grad = backward_step(
                    output,
                    ctx,
                    input_tensor=input_tensor,
                    output_tensor_grad=None if last_vstage(chunk) else from_next,
                )
                if backwards_left[chunk] == 0 and grad_sync_func is not None:
                    grad_sync_func(model_chunks[chunk].parameters())
                if not first_vstage(chunk):
                    send_prev = input_grad
            if callback is not None:
                callback(PipelineEvent(pp_rank, chunk, mb, kind, start, time.monotonic_ns()))
        communicator.exchange(send_next=send_next, send_prev=send_prev, tensor_shape=tensor_shape)
        communicator.wait_for_sends()
    if not forward_only:
        _finalize_grads(ctx, model_chunks, total_tokens)
    return forward_data_store


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func: Callable,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator: Optional[P2PCommunicator] = None,
    pg_collection=None,
    step_context: Optional[StepContext] = None,
) -> List[Any]:
    """1F1B over the pipeline group: PP - rank - 1 warm-up forwards (at most M), then alternating
    one forward / one backward, then the remaining backwards. Returns the reported losses on the
    last stage (an empty list elsewhere). ``pg_collection`` is the ``ParallelState``."""
    model_chunks = _as_list(model, 1, "model")
    data_iterators = _as_list(data_iterator, 1, "data_iterator")
    config = get_model_config(model_chunks[0])
    if config.variable_seq_lengths:
        raise ValueError(
            "variable sequence lengths are not supported by the pipeline schedules yet"
        )
    ctx = _resolve_context(step_context, config)
    communicator = _resolve_communicator(config, ctx, p2p_communicator, pg_collection)
    tensor_shape = _adjusted_shape(
        adjust_tensor_shapes_fn, get_tensor_shape(seq_length, micro_batch_size, config)
    )
    num_warmup = communicator.world_size - communicator.rank - 1
    table = [(mb, 0) for mb in range(num_microbatches)]
    return _run_pipeline(
        forward_step_func=forward_step_func,
        data_iterators=data_iterators,
        model_chunks=model_chunks,
        num_microbatches=num_microbatches,
        config=config,
        ctx=ctx,
        communicator=communicator,
        tensor_shape=tensor_shape,
        table=table,
        num_warmup=num_warmup,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func: Callable,
    data_iterator: List[Iterator],
    model: List[torch.nn.Module],
    num_microbatches: int,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator: Optional[P2PCommunicator] = None,
    pg_collection=None,
    step_context: Optional[StepContext] = None,
) -> List[Any]:
    """Interleaved 1F1B: ``model`` and ``data_iterator`` are lists with one entry per chunk
    (virtual stage); chunk c on rank r is virtual stage c * PP + r.

    Groups of G micro-batches (the step context's ``microbatch_group_size_per_vp_stage``,
    default PP) run through chunk 0, 1, ... in turn; warm-up = (PP - rank - 1) * 2 +
    (chunks - 1) * G forwards.
    Megatron's micro-batch rules (PP <= G <= M; M mod G = 0 or >= PP) raise ValueError.
    """
    _no_adjusted_shapes(adjust_tensor_shapes_fn, "interleaved")
    if not isinstance(model, (list, tuple)) or len(model) < 2:
        raise ValueError(
            "the interleaved schedule needs a list of at least two model chunks "
            "(one per virtual pipeline stage)"
        )
    model_chunks = list(model)
    data_iterators = _as_list(data_iterator, len(model_chunks), "data_iterator")
    config = get_model_config(model_chunks[0])
    if config.variable_seq_lengths:
        raise ValueError(
            "variable sequence lengths are not supported by the pipeline schedules yet"
        )
    ctx = _resolve_context(step_context, config)
    communicator = _resolve_communicator(config, ctx, p2p_communicator, pg_collection)
    pp, rank = communicator.world_size, communicator.rank
    if pp < 2:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    group = check_interleaved_microbatches(
        num_microbatches, pp, ctx.microbatch_group_size_per_vp_stage
    )
    tensor_shape = get_tensor_shape(seq_length, micro_batch_size, config)
    num_chunks = len(model_chunks)
    num_warmup = (pp - rank - 1) * 2 + (num_chunks - 1) * group
    table = get_schedule_table(num_microbatches, num_chunks, group)
    return _run_pipeline(
        forward_step_func=forward_step_func,
        data_iterators=data_iterators,
        model_chunks=model_chunks,
        num_microbatches=num_microbatches,
        config=config,
        ctx=ctx,
        communicator=communicator,
        tensor_shape=tensor_shape,
        table=table,
        num_warmup=num_warmup,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )
