"""The no-pipelining schedule lets go of a micro-batch's autograd graph before the next forward.

Why it matters: while an old graph is alive, the next forward reuses its AccumulateGrad nodes,
which keep the CUDA stream they were made on. ``--cuda-graph-impl local`` captures a layer's
forward and backward on torch's capture stream; if that forward reused nodes made during an
eager micro-batch on the default (legacy) stream, the captured backward would make the legacy
stream wait on the capturing one, and the capture fails (cudaErrorStreamCaptureImplicit, seen on
an H200 by benchmarks/layer_graphs_check.py, which held its previous loss the same way). A marker
object tied to each micro-batch's graph shows on the CPU whether the graph is still alive."""

import weakref

import torch

from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from tests.unit_tests.tiny_configs import tiny_gpt_model

VOCAB, SEQ, MBS, M = 32, 8, 2, 3


class _Marker:
    """Lives exactly as long as the autograd node whose ctx holds it."""


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, marker):
        ctx.marker = marker
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def test_no_micro_batch_graph_is_alive_at_the_next_forward():
    model = tiny_gpt_model(seed=3, vocab_size=VOCAB, max_sequence_length=SEQ)
    g = torch.Generator().manual_seed(1)
    markers, alive_at_forward = [], []

    def forward_step_func(data_iterator, model):
        next(data_iterator)
        alive_at_forward.append([ref() is not None for ref in markers])
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        out = model(tokens, torch.arange(SEQ).expand(MBS, SEQ), None, labels=tokens)
        marker = _Marker()
        markers.append(weakref.ref(marker))
        out = _Tie.apply(out, marker)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    model.config.finalize_model_grads_func = lambda *args, **kwargs: None
    forward_backward_no_pipelining(
        forward_step_func=forward_step_func,
        data_iterator=iter(range(M)),
        model=model,
        num_microbatches=M,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    assert alive_at_forward == [[], [False], [False, False]]
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
