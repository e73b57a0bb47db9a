"""Per-layer CUDA graphs of the training step (``--cuda-graph-impl local``, Megatron's
CudaGraphManager in spirit; ``--enable-cuda-graph`` is its deprecated spelling).

Each transformer layer of a block gets a :class:`LayerGraphRunner`. Its first
``cuda_graph_warmup_steps`` training forwards (for one input signature: the shapes, dtypes and
``requires_grad`` of the tensor arguments and the values of the others) run eagerly, which also
warms cuBLAS and the allocator up. The count is of micro-batches (Megatron counts iterations:
the same with one micro-batch per iteration, as in the one-GPU GPT-2 large run). The next one
captures the layer's forward and its backward
(``torch.autograd.grad`` of the outputs with respect to the tensor inputs that need a gradient
and the layer's parameters that the forward reaches) into two graphs that share one memory pool
per block, then replays the forward; its backward replays the backward graph. From then on a
call copies its tensor arguments into the static input buffers, replays, and hands autograd
detached aliases of the static outputs (:class:`_GraphedLayer`); autograd accumulates the
returned parameter gradients as usual (DDP's hook adds them into ``main_grad``), and the weights
that gradient accumulation fusion handles are added into ``main_grad`` inside the backward graph
itself (the grad buffer never moves).

What the replay needs, and what is refused where it cannot hold (one line naming the flag: the
training side in ``megatron/training/flags/rules/layer.py``):

* CUDA (a CPU has no graphs): the real backend is :class:`CudaGraphPair`;
* the forward of a layer is followed by its backward before the layer's next forward: the saved
  activations live in the graph's static memory. A second forward while a backward is pending
  raises (a pipeline schedule keeps several micro-batches in flight: ``--pipeline-model-parallel-
  size`` > 1 is refused, as are activation recompute, which replays forwards inside backward);
* no random numbers inside the layer (the RNG tracker swaps generator states on the host, which a
  graph cannot capture): dropout must be 0;
* no host synchronisation or data-dependent shape inside the layer (MoE routing is refused);
* no collectives inside the layer (TP, CP and EP > 1 are refused) and none launched from
  backward hooks (``--overlap-grad-reduce`` is refused: the readiness calls would not replay);
* evaluation, ``no_grad`` forwards and generation (a KV cache) run eagerly.

The bookkeeping (signatures, warm-up counts, static buffers, which gradients flow where, the
pending-backward check) does not depend on the device: a backend with the same four calls that
replays by running the layer eagerly on the static buffers (:class:`EagerReplay`) proves it on the
CPU. Only the capture itself (the kernels recorded, the pool sharing, the speed) needs a GPU.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

MAX_SIGNATURES = 4
"""Input signatures one layer may capture; more means the shapes vary from step to step."""


class CudaGraphPair:
    """The forward and backward CUDA graphs of one layer and signature, captured into the
    block's shared memory pool (``pool_owner.pool``, created on first use)."""

    def __init__(self, pool_owner: "LayerGraphs"):
        self.pool_owner = pool_owner
        self.forward_graph = self.backward_graph = None

    def capture_forward(self, fn: Callable, static_inputs: Sequence[torch.Tensor]):
        devices = {x.device.type for x in static_inputs}
        if devices != {"cuda"}:
            raise ValueError(
                "--cuda-graph-impl local needs CUDA: the layer's inputs are on "
                f"{', '.join(sorted(devices))}"
            )
        self.forward_graph = torch.cuda.CUDAGraph()
        self.backward_graph = torch.cuda.CUDAGraph()
        if self.pool_owner.pool is None:
            self.pool_owner.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(self.forward_graph, pool=self.pool_owner.pool):
            return fn(*static_inputs)

    def capture_backward(self, outputs, inputs, grad_outputs) -> List[torch.Tensor]:
        # retain_graph: the saved activations stay allocated, so that no later capture in the
        # shared pool can place its tensors on them.
        with torch.cuda.graph(self.backward_graph, pool=self.pool_owner.pool):
            return list(
                torch.autograd.grad(
                    outputs, inputs, grad_outputs, retain_graph=True, allow_unused=True
                )
            )

    def replay_forward(self) -> None:
        self.forward_graph.replay()

    def replay_backward(self) -> None:
        self.backward_graph.replay()


class EagerReplay:
    """A backend without graphs, with their semantics: a replay reads only the static inputs and
    writes only the static outputs (and what the captured code writes, such as ``main_grad``).
    The capture calls run nothing that a real capture would not record (no backward)."""

    def __init__(self, pool_owner: "LayerGraphs"):
        self.fn = self.static_inputs = self.outputs = None
        self.live_outputs = None

    def capture_forward(self, fn, static_inputs):
        self.fn, self.static_inputs = fn, static_inputs
        self.outputs = fn(*static_inputs)
        return self.outputs

    def capture_backward(self, outputs, inputs, grad_outputs):
        self.inputs, self.grad_outputs = inputs, grad_outputs
        self.grads = [torch.empty_like(x) for x in inputs]
        return self.grads

    def replay_forward(self):
        with torch.enable_grad():
            live, _ = tree_flatten(self.fn(*self.static_inputs))
        self.live_outputs = [x for x in live if isinstance(x, torch.Tensor)]
        static, _ = tree_flatten(self.outputs)
        with torch.no_grad():
            for s, x in zip([x for x in static if isinstance(x, torch.Tensor)], self.live_outputs):
                s.copy_(x)

    def replay_backward(self):
        live = [x for x in self.live_outputs if x.requires_grad]
        grads = torch.autograd.grad(live, self.inputs, self.grad_outputs, allow_unused=True)
        with torch.no_grad():
            for s, g in zip(self.grads, grads):
                s.zero_() if g is None else s.copy_(g)


def _reachable_leaves(outputs: Sequence[torch.Tensor]) -> set:
    """ids of the leaf tensors whose AccumulateGrad nodes backward from ``outputs`` reaches (the
    weights that gradient accumulation fusion detaches are not among them)."""
    seen, leaves = set(), set()
    stack = [x.grad_fn for x in outputs if x.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


class _CapturedLayer:
    """The static buffers and graphs of one layer for one input signature."""

    def __init__(self, backend, fn: Callable, args: List[torch.Tensor], params):
        self.backend = backend
        self.static_inputs = [torch.empty_like(x).requires_grad_(x.requires_grad) for x in args]
        with torch.no_grad():
            for s, x in zip(self.static_inputs, args):
                s.copy_(x)
        with torch.enable_grad():
            outputs = backend.capture_forward(fn, self.static_inputs)
        flat, self.out_spec = tree_flatten(outputs)
        self.out_is_tensor = [isinstance(x, torch.Tensor) for x in flat]
        self.out_constants = [None if t else x for x, t in zip(flat, self.out_is_tensor)]
        self.static_outputs = [x for x in flat if isinstance(x, torch.Tensor)]
        input_ids = {id(x) for x in self.static_inputs} | {id(x) for x in args}
        if any(id(x) in input_ids for x in self.static_outputs):
            raise ValueError(
                "--cuda-graph-impl local: a layer returned one of its inputs; such a layer "
                "cannot be captured"
            )
        self.grad_outputs = [x for x in self.static_outputs if x.requires_grad]
        reached = _reachable_leaves(self.grad_outputs)
        self.grad_input_index = [i for i, x in enumerate(self.static_inputs) if x.requires_grad]
        self.params = [p for p in params if p.requires_grad and id(p) in reached]
        wrt = [self.static_inputs[i] for i in self.grad_input_index] + self.params
        self.static_grad_outputs = [torch.zeros_like(x) for x in self.grad_outputs]
        self.static_grads = backend.capture_backward(
            self.grad_outputs, wrt, self.static_grad_outputs
        )
        self.backward_pending = False

    def outputs(self, tensors: Sequence[torch.Tensor]):
        it = iter(tensors)
        flat = [next(it) if t else c for t, c in zip(self.out_is_tensor, self.out_constants)]
        return tree_unflatten(flat, self.out_spec)


class _GraphedLayer(torch.autograd.Function):
    """Replays a captured layer: inputs are the call's tensor arguments (all, in order) then the
    parameters whose gradients the backward graph produces."""

    @staticmethod
    def forward(ctx, captured: _CapturedLayer, num_args: int, *tensors):
        if captured.backward_pending:
            raise RuntimeError(
                "--cuda-graph-impl local: a layer ran its next forward before the backward of "
                "the previous one (more than one micro-batch in flight); its captured "
                "activations would be overwritten"
            )
        for static, x in zip(captured.static_inputs, tensors[:num_args]):
            static.copy_(x)
        captured.backend.replay_forward()
        captured.backward_pending = bool(captured.grad_outputs)
        ctx.captured, ctx.num_args = captured, num_args
        outputs = tuple(x.detach() for x in captured.static_outputs)
        ctx.mark_non_differentiable(
            *[o for o, s in zip(outputs, captured.static_outputs) if not s.requires_grad]
        )
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        captured = ctx.captured
        if not captured.backward_pending:
            raise RuntimeError(
                "--cuda-graph-impl local: a captured layer's backward ran twice for one forward"
            )
        grads_of_differentiable = [
            g for g, s in zip(grads, captured.static_outputs) if s.requires_grad
        ]
        for static, g in zip(captured.static_grad_outputs, grads_of_differentiable):
            static.zero_() if g is None else static.copy_(g)
        captured.backend.replay_backward()
        captured.backward_pending = False
        results = [None] * (2 + ctx.num_args + len(captured.params))
        n = len(captured.grad_input_index)
        for i, g in zip(captured.grad_input_index, captured.static_grads[:n]):
            results[2 + i] = None if g is None else g.detach()
        # Copies: autograd may keep a parameter's gradient as its .grad (no DDP to consume it),
        # and the next replay rewrites the static one.
        for j, g in enumerate(captured.static_grads[n:]):
            results[2 + ctx.num_args + j] = None if g is None else g.clone()
        return tuple(results)


def _signature(flat_args) -> Tuple:
    return tuple(
        (tuple(x.shape), x.dtype, x.device, x.requires_grad)
        if isinstance(x, torch.Tensor)
        else ("const", x)
        for x in flat_args
    )


class LayerGraphRunner:
    """Calls one layer: eagerly during warm-up and outside training, else through its graphs."""

    def __init__(self, layer: torch.nn.Module, owner: "LayerGraphs"):
        self.layer = layer
        self.owner = owner
        self.eager_calls: Dict[Tuple, int] = {}
        """Training forwards run eagerly so far, per signature (the warm-up count)."""
        self.captured: Dict[Tuple, _CapturedLayer] = {}
        self.replays = 0
        """Forwards replayed from a graph (for tests and logs)."""

    def __call__(self, hidden_states, **kwargs):
        if (
            not self.layer.training
            or not torch.is_grad_enabled()
            or kwargs.get("inference_context") is not None
        ):
            return self.layer(hidden_states, **kwargs)
        flat, spec = tree_flatten((hidden_states, kwargs))
        signature = (_signature(flat), spec)
        captured = self.captured.get(signature)
        if captured is None:
            done = self.eager_calls.get(signature, 0)
            if done < self.owner.warmup_steps:
                self.eager_calls[signature] = done + 1
                return self.layer(hidden_states, **kwargs)
            if len(self.captured) >= MAX_SIGNATURES:
                raise ValueError(
                    f"--cuda-graph-impl local: layer {getattr(self.layer, 'layer_number', '?')} "
                    f"saw more than {MAX_SIGNATURES} input shapes; graphs need fixed shapes "
                    "(fixed --seq-length and --micro-batch-size, no variable-length batches)"
                )
            captured = self._capture(flat, spec)
            self.captured[signature] = captured
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        outputs = _GraphedLayer.apply(captured, len(tensors), *tensors, *captured.params)
        self.replays += 1
        return captured.outputs(outputs)

    def _capture(self, flat, spec) -> _CapturedLayer:
        is_tensor = [isinstance(x, torch.Tensor) for x in flat]
        constants = [None if t else x for x, t in zip(flat, is_tensor)]

        def run(*static_inputs):
            it = iter(static_inputs)
            hidden, kwargs = tree_unflatten(
                [next(it) if t else c for t, c in zip(is_tensor, constants)], spec
            )
            return self.layer(hidden, **kwargs)

        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        backend = self.owner.backend(self.owner)
        return _CapturedLayer(backend, run, tensors, list(self.layer.parameters()))


class LayerGraphs:
    """The graph runners of one block's layers, their warm-up count and shared memory pool.

    ``backend``: the class that captures and replays (:class:`CudaGraphPair`; tests pass
    :class:`EagerReplay`)."""

    def __init__(self, layers, warmup_steps: int, backend: Optional[Callable] = None):
        if warmup_steps < 1:
            raise ValueError(
                f"--cuda-graph-warmup-steps must be at least 1 (got {warmup_steps}): the eager "
                "steps initialise what a capture cannot (cuBLAS handles, the allocator)"
            )
        self.warmup_steps = warmup_steps
        self.backend = backend or CudaGraphPair
        self.pool = None
        self.runners = [LayerGraphRunner(layer, self) for layer in layers]


def layer_graphs_for(config, layers) -> Optional[LayerGraphs]:
    """The block's :class:`LayerGraphs` when ``config.cuda_graph_impl`` is 'local', else None.
    The configurations the replay cannot serve are refused here too, for library users (the
    training side refuses them with its flags' names first)."""
    if getattr(config, "cuda_graph_impl", "none") != "local":
        return None
    for ok, why in (
        (config.pipeline_model_parallel_size == 1, "pipeline_model_parallel_size > 1"),
        (config.tensor_model_parallel_size == 1, "tensor_model_parallel_size > 1"),
        (config.context_parallel_size == 1, "context_parallel_size > 1"),
        (not config.num_moe_experts, "num_moe_experts (MoE layers)"),
        (config.hidden_dropout == 0 and config.attention_dropout == 0, "dropout"),
        (config.recompute_granularity is None, "recompute_granularity"),
    ):
        if not ok:
            raise ValueError(
                f"cuda_graph_impl='local' (--cuda-graph-impl local) does not support {why}"
            )
    return LayerGraphs(layers, int(config.cuda_graph_warmup_steps))
