"""The Mamba-2 layer in plain PyTorch.

* The chunked SSD scan equals the step-by-step recurrence in float64 (1e-6 absolute is asked;
  several chunk sizes, a length that is not a multiple of the chunk, groups shared by heads,
  an initial state), outputs and final state.
* The depthwise convolution is causal: changing input t leaves outputs before t unchanged.
* The hybrid model (M * - M) at TP=2 with sequence parallelism (spawned gloo processes): loss
  and every gradient equal the one-process model's (each rank compares its shard, cut from the
  full gradient by the parameter's partition sizes).
"""

import pytest
import torch

from megatron.core.models.mamba import MambaModel
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.ssm.mamba_mixer import shard_parts
from megatron.core.ssm.ssd import causal_depthwise_conv1d, ssd_chunked, ssd_recurrent
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed

VOCAB, SEQ, BATCH = 64, 12, 2
PATTERN = "M*-M"


def _ssm_inputs(b=2, length=13, h=4, p=3, g=2, n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, B, C = randn(b, length, h, p), randn(b, length, g, n), randn(b, length, g, n)
    dt = torch.rand(b, length, h, generator=gen, dtype=torch.float64)
    A = -3 * torch.rand(h, generator=gen, dtype=torch.float64)
    return x, dt, A, B, C, randn(h), randn(b, h, p, n)


@pytest.mark.parametrize("chunk", [1, 4, 5, 16])
@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero_state", "initial_state"])
def test_chunked_scan_equals_recurrence_in_float64(chunk, with_initial_state):
    x, dt, A, B, C, D, s0 = _ssm_inputs()
    s0 = s0 if with_initial_state else None
    y, state = ssd_chunked(x, dt, A, B, C, chunk, D, initial_state=s0)
    y_ref, state_ref = ssd_recurrent(x, dt, A, B, C, D, initial_state=s0)
    assert (y - y_ref).abs().max().item() < 1e-6
    assert (state - state_ref).abs().max().item() < 1e-6
    assert y_ref.abs().max() > 0.1  # not a vacuous comparison


def test_conv_is_causal():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 10, generator=gen, dtype=torch.float64)
    w = torch.randn(6, 1, 4, generator=gen, dtype=torch.float64)
    out = causal_depthwise_conv1d(x, w, None)
    x2 = x.clone()
    x2[..., 5] += 1.0
    out2 = causal_depthwise_conv1d(x2, w, None)
    assert torch.equal(out[..., :5], out2[..., :5])
    assert not torch.equal(out[..., 5], out2[..., 5])
    # A history of the previous inputs continues the sequence exactly.
    split = causal_depthwise_conv1d(x[..., 7:], w, None, history=x[..., 4:7])
    assert torch.allclose(split, out[..., 7:])


def tiny_config(**overrides):
    base = dict(
        num_layers=len(PATTERN),
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=32,
        mamba_state_dim=8,
        mamba_head_dim=4,
        mamba_num_groups=2,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_seed=1234,
        params_dtype=torch.float64,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def tiny_model(pg_collection=None, **overrides):
    return MambaModel(
        tiny_config(**overrides),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        hybrid_override_pattern=PATTERN,
        pg_collection=pg_collection,
    ).double()


def _batch():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _loss_and_grads(model):
    tokens, labels = _batch()
    loss = model(tokens, None, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_mamba_model_key_layout():
    names = set(tiny_model().state_dict())
    for key in (
        "decoder.layers.0.norm.weight",
        "decoder.layers.0.mixer.in_proj.weight",
        "decoder.layers.0.mixer.conv1d.weight",
        "decoder.layers.0.mixer.conv1d.bias",
        "decoder.layers.0.mixer.dt_bias",
        "decoder.layers.0.mixer.A_log",
        "decoder.layers.0.mixer.D",
        "decoder.layers.0.mixer.norm.weight",
        "decoder.layers.0.mixer.out_proj.weight",
        "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.2.pre_mlp_layernorm.weight",
        "decoder.layers.2.mlp.linear_fc1.weight",
        "decoder.final_norm.weight",
    ):
        assert key in names, key
    assert not any("final_layernorm" in n for n in names)


def _tp_worker(rank, world_size):
    torch.set_num_threads(1)
    ref_loss, ref_grads = _loss_and_grads(tiny_model())
    state = initialize_model_parallel(tensor_model_parallel_size=world_size)
    model = tiny_model(state, tensor_model_parallel_size=world_size, sequence_parallel=True)
    loss, _ = _loss_and_grads(model)
    # The per-token cross entropy is computed in float32 (fp32 softmax) even in a float64 model.
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item()), (loss, ref_loss)
    checked = 0
    for name, param in model.named_parameters():
        full = ref_grads[name]
        grad = param.grad
        if getattr(param, "tensor_model_parallel", False):
            dim = param.partition_dim
            parts = [s * world_size for s in getattr(param, "partition_sizes", [param.shape[dim]])]
            full = shard_parts(full, dim, parts, rank, world_size)
            checked += 1
        elif getattr(param, "sequence_parallel", False):
            grad = grad.clone()
            torch.distributed.all_reduce(grad)  # each rank saw its half of the sequence
        # float32 cross entropy: compare relative to the tensor's largest entry.
        error = (grad - full).abs().max().item()
        assert error <= 1e-5 * full.abs().max().item(), (name, error)
    assert checked >= 9  # the Mamba, attention and MLP shards were compared


def test_tp2_sequence_parallel_equals_one_process():
    run_distributed(_tp_worker, 2)
