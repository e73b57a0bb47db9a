"""Point-to-point exchange of activations and gradients between neighbouring pipeline stages.

Every operation posts its sends and receives together with ``torch.distributed.batch_isend_irecv``
(works on gloo and NCCL) and waits for the receives only: a send's completion is collected later
(:meth:`P2PCommunicator.wait_for_sends`, called by the schedules at the end), which never delays
a stage more than Megatron's wait-for-everything batches and keeps the sent tensor alive until
then. The previous / next stage wrap around the pipeline group, which is what the interleaved
schedule needs (chunk c+1 on rank 0 receives from chunk c on the last rank); whether an operation
talks to a neighbour at all is the caller's decision (``is_first_stage`` / ``is_last_stage``).

Activations travel with tag 0 and gradients with tag 1, so on gloo the two streams between the
same pair of ranks (PP = 2 with interleaving) can never be confused.

Tensor shape: ``[seq_length / CP (/ TP with sequence parallelism), micro_batch_size, hidden_size]``
(see :func:`get_tensor_shape`); dtype ``config.pipeline_dtype`` (fp32 with
``fp32_residual_connection``).

Timers (level 2, as Megatron): forward-recv, forward-send, backward-recv, backward-send,
forward-send-forward-recv, forward-send-backward-recv, backward-send-forward-recv,
backward-send-backward-recv, forward-backward-send-forward-backward-recv.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.device import collective_device
from megatron.core.pipeline_parallel.step_context import StepContext

_ACTIVATION_TAG = 0
_GRADIENT_TAG = 1


def get_tensor_shape(seq_length: int, micro_batch_size: int, config) -> Tuple[int, int, int]:
    """Shape of the activation passed between stages: ``[s/CP (/TP with SP), mbs, h]``."""
    if seq_length is None or micro_batch_size is None:
        raise ValueError(
            "pipeline schedules need seq_length and micro_batch_size to size the p2p tensors"
        )
    cp, tp = config.context_parallel_size, config.tensor_model_parallel_size
    if seq_length % cp != 0:
        raise ValueError(
            f"seq_length ({seq_length}) must be divisible by --context-parallel-size ({cp})"
        )
    seq = seq_length // cp
    if config.sequence_parallel and tp > 1:
        if seq % tp != 0:
            raise ValueError(
                f"sequence length per context-parallel rank ({seq}) must be divisible by "
                f"--tensor-model-parallel-size ({tp}) with --sequence-parallel"
            )
        seq //= tp
    return (seq, micro_batch_size, config.hidden_size)


def get_pipeline_dtype(config) -> torch.dtype:
    """fp32 with ``fp32_residual_connection`` (a TransformerConfig field), else the config's
    ``pipeline_dtype`` (``params_dtype`` unless set)."""
    if getattr(config, "fp32_residual_connection", False):
        return torch.float32
    return config.pipeline_dtype if config.pipeline_dtype is not None else config.params_dtype


class P2PCommunicator:
    """Sends/receives between this rank and its neighbours in ``pp_group``.

    ``config`` supplies the dtype and the device-independent shape rules; ``device`` is where
    received tensors are allocated (default: the group's collective device). ``timers`` times
    the exchanges (level 2); without them, those a Megatron Core caller set on the config.
    """

    def __init__(
        self,
        pp_group,
        config,
        device: Optional[torch.device] = None,
        timers=None,
    ):
        self.group = pp_group
        self.config = config
        self.timers = timers if timers is not None else StepContext.from_config(config).timers
        self.world_size = dist.get_world_size(pp_group) if pp_group is not None else 1
        self.rank = dist.get_rank(pp_group) if pp_group is not None else 0
        if self.world_size > 1:
            self.prev_rank = dist.get_global_rank(pp_group, (self.rank - 1) % self.world_size)
            self.next_rank = dist.get_global_rank(pp_group, (self.rank + 1) % self.world_size)
        else:
            self.prev_rank = self.next_rank = None
        self.device = device if device is not None else collective_device(pp_group)
        self.dtype = get_pipeline_dtype(config)
        self._pending_sends: List[Tuple[object, torch.Tensor]] = []

    # ------------------------------------------------------------------------------ helpers
    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.rank == self.world_size - 1

    def _timer(self, name: str):
        return self.timers(name, log_level=2) if self.timers is not None else None

    def _empty(self, shape) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=self.dtype, device=self.device)

    def _outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.dtype != self.dtype:
            tensor = tensor.to(self.dtype)
        return tensor.contiguous()

    def _communicate(
        self,
        name: str,
        *,
        send_next: Optional[torch.Tensor] = None,
        send_prev: Optional[torch.Tensor] = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        tensor_shape=None,
    ):
        """Post all given sends/receives as one batch; wait for the receives.

        Returns ``(from_prev, from_next)``; each is None unless requested.
        """
        if self.world_size == 1:
            if send_next is not None or send_prev is not None or recv_prev or recv_next:
                raise ValueError("p2p communication needs a pipeline group of size > 1")
            return None, None
        if (recv_prev or recv_next) and tensor_shape is None:
            raise ValueError("a p2p receive needs tensor_shape")
        timer = self._timer(name)
        if timer:
            timer.start()
        ops, sends = [], []
        from_prev = self._empty(tensor_shape) if recv_prev else None
        from_next = self._empty(tensor_shape) if recv_next else None
        # Activations (forward direction) first, then gradients, on every rank: one fixed order.
        if send_next is not None:
            t = self._outgoing(send_next)
            sends.append(t)
            ops.append(dist.P2POp(dist.isend, t, self.next_rank, self.group, _ACTIVATION_TAG))
        if from_prev is not None:
            ops.append(
                dist.P2POp(dist.irecv, from_prev, self.prev_rank, self.group, _ACTIVATION_TAG)
            )
        if send_prev is not None:
            t = self._outgoing(send_prev)
            sends.append(t)
            ops.append(dist.P2POp(dist.isend, t, self.prev_rank, self.group, _GRADIENT_TAG))
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next, self.next_rank, self.group, _GRADIENT_TAG))
        if ops:
            works = dist.batch_isend_irecv(ops)
            n_send = 0
            for op, work in zip(ops, works):
                if op.op is dist.isend:
                    self._pending_sends.append((work, sends[n_send]))
                    n_send += 1
                else:
                    work.wait()
            # Never block on a send here: with PP = 2 and interleaving both neighbours are the same
            # rank, and a send waited on before the peer posts its matching receive (in a later
            # exchange) deadlocks. Finished sends are released so their buffers can be freed.
            self._pending_sends = [(w, t) for w, t in self._pending_sends if not w.is_completed()]
        if timer:
            timer.stop()
        return from_prev, from_next

    def wait_for_sends(self) -> None:
        """Block until every posted send has completed (end of a schedule)."""
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()

    # ------------------------------------------------------------------------------ operations
    def recv_forward(
        self, tensor_shape, is_first_stage: Optional[bool] = None
    ) -> Optional[torch.Tensor]:
        """Activation from the previous stage (None on the first stage)."""
        if self._first(is_first_stage):
            return None
        return self._communicate("forward-recv", recv_prev=True, tensor_shape=tensor_shape)[0]

    def recv_backward(
        self, tensor_shape, is_last_stage: Optional[bool] = None
    ) -> Optional[torch.Tensor]:
        """Gradient of this stage's output from the next stage (None on the last stage)."""
        if self._last(is_last_stage):
            return None
        return self._communicate("backward-recv", recv_next=True, tensor_shape=tensor_shape)[1]

    def send_forward(self, output_tensor, is_last_stage: Optional[bool] = None) -> None:
        if self._last(is_last_stage) or output_tensor is None:
            return
        self._communicate("forward-send", send_next=output_tensor)

    def send_backward(self, input_tensor_grad, is_first_stage: Optional[bool] = None) -> None:
        if self._first(is_first_stage) or input_tensor_grad is None:
            return
        self._communicate("backward-send", send_prev=input_tensor_grad)

    def send_forward_recv_backward(
        self, output_tensor, tensor_shape, is_last_stage: Optional[bool] = None
    ) -> Optional[torch.Tensor]:
        if self._last(is_last_stage):
            return None
        return self._communicate(
            "forward-send-backward-recv",
            send_next=output_tensor,
            recv_next=True,
            tensor_shape=tensor_shape,
        )[1]

    def send_backward_recv_forward(
        self, input_tensor_grad, tensor_shape, is_first_stage: Optional[bool] = None
    ) -> Optional[torch.Tensor]:
        if self._first(is_first_stage):
            return None
        return self._communicate(
            "backward-send-forward-recv",
            send_prev=input_tensor_grad,
            recv_prev=True,
            tensor_shape=tensor_shape,
        )[0]

    def send_forward_recv_forward(
        self, output_tensor, recv_prev: bool, tensor_shape
    ) -> Optional[torch.Tensor]:
        """Send to the next stage (if ``output_tensor``) and receive from the previous (if
        ``recv_prev``)."""
        return self._communicate(
            "forward-send-forward-recv",
            send_next=output_tensor,
            recv_prev=recv_prev,
            tensor_shape=tensor_shape,
        )[0]

    def send_backward_recv_backward(
        self, input_tensor_grad, recv_next: bool, tensor_shape
    ) -> Optional[torch.Tensor]:
        """Send to the previous stage (if ``input_tensor_grad``) and receive from the next (if
        ``recv_next``)."""
        return self._communicate(
            "backward-send-backward-recv",
            send_prev=input_tensor_grad,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
        )[1]

    def send_forward_backward_recv_forward_backward(
        self, output_tensor, input_tensor_grad, recv_prev: bool, recv_next: bool, tensor_shape
    ):
        """All four directions in one batch; returns ``(input_tensor, output_tensor_grad)``."""
        return self._communicate(
            "forward-backward-send-forward-backward-recv",
            send_next=output_tensor,
            send_prev=input_tensor_grad,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
        )

    def exchange(
        self,
        *,
        send_next=None,
        send_prev=None,
        recv_prev: bool = False,
        recv_next: bool = False,
        tensor_shape=None,
    ):
        """Any combination of the four directions, named by Megatron's timer for that
        combination."""
        forward = send_next is not None or recv_prev
        backward = send_prev is not None or recv_next
        if not forward and not backward:
            return None, None
        sends = [
            d
            for d, on in (("forward", send_next is not None), ("backward", send_prev is not None))
            if on
        ]
        recvs = [d for d, on in (("forward", recv_prev), ("backward", recv_next)) if on]
        if len(sends) == 2 or len(recvs) == 2:
            name = "forward-backward-send-forward-backward-recv"
        elif sends and recvs:
            name = f"{sends[0]}-send-{recvs[0]}-recv"
        elif sends:
            name = f"{sends[0]}-send"
        else:
            name = f"{recvs[0]}-recv"
        return self._communicate(
            name,
            send_next=send_next,
            send_prev=send_prev,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
        )

    def _first(self, flag: Optional[bool]) -> bool:
        return self.is_pipeline_first_stage if flag is None else flag

    def _last(self, flag: Optional[bool]) -> bool:
        return self.is_pipeline_last_stage if flag is None else flag
