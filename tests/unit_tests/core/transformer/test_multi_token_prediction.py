"""Multi-token prediction against a float64 hand computation of DeepSeek-V3's MTP formula on
the model's own weights, and its parameter names and roll at one process."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.multi_token_prediction import roll_tensor
from tests.unit_tests.tiny_configs import tiny_transformer_config

VOCAB, SEQ, BATCH = 37, 8, 2


def _model(depths, factor=0.3, **cfg):
    config = tiny_transformer_config(
        mtp_num_layers=depths,
        mtp_loss_scaling_factor=factor,
        normalization="RMSNorm",
        params_dtype=torch.float64,
        init_seed=5,
        **cfg,
    )
    spec = get_gpt_layer_local_spec()
    torch.manual_seed(0)
    return GPTModel(
        config,
        spec,
        VOCAB,
        SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        # The cross entropy in the logits' dtype (float64), not float32.
        fp16_lm_cross_entropy=True,
        mtp_block_spec=spec,
    ).double()


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _shift(t, k):
    """t shifted left by k along the sequence, zeros entering at the end."""
    out = torch.zeros_like(t)
    out[:, : t.shape[1] - k] = t[:, k:]
    return out


def test_parameter_names_are_megatrons():
    keys = set(_model(2).state_dict())
    for k in range(2):
        for name in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "transformer_layer.self_attention.linear_qkv.weight",
            "transformer_layer.mlp.linear_fc2.weight",
            "final_layernorm.weight",
        ):
            assert f"mtp.layers.{k}.{name}" in keys
    assert "mtp.layers.2.enorm.weight" not in keys


def test_refusals_name_the_setting():
    config = tiny_transformer_config(mtp_num_layers=1)
    spec = get_gpt_layer_local_spec()
    with pytest.raises(ValueError, match="position_embedding_type rope or none"):
        GPTModel(config, spec, VOCAB, SEQ, mtp_block_spec=spec)
    with pytest.raises(ValueError, match="needs config.mtp_num_layers >= 1"):
        GPTModel(tiny_transformer_config(), spec, VOCAB, SEQ, mtp_block_spec=spec)


def test_roll_tensor_one_process():
    t = torch.arange(1, 7).view(1, 6)
    rolled, total = roll_tensor(t)
    assert rolled.tolist() == [[2, 3, 4, 5, 6, 0]] and int(total) == 20
    with pytest.raises(ValueError, match="shifts only by -1"):
        roll_tensor(t, shifts=1)


def test_mtp_loss_and_gradients_equal_float64_formula():
    """The MTP term in backward equals d/dθ of factor/D * Σ_k mean_k(CE) computed by hand
    (RMSNorm, concat [enorm(emb(x shifted k)); hnorm(h_{k-1})], eh_proj, the same transformer
    layer, final norm, the shared output layer), with a loss mask."""
    depths, factor = 2, 0.3
    model = _model(depths, factor)
    model.train()
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    mask = (torch.rand(BATCH, SEQ) > 0.2).double()
    scale = 0.5  # the schedule's factor for the MTP losses
    model.set_mtp_loss_scale(scale)
    losses = model(tokens, None, None, labels=labels, loss_mask=mask)
    (losses * mask).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    tracked = model.mtp.mtp_metrics()

    # The reference: the main loss plus scale * factor/D * Σ_k mean_k, from the same weights.
    model.zero_grad()
    eps = model.config.layernorm_epsilon
    emb = model.embedding.word_embeddings.weight
    out_w = model.output_layer.weight
    cos_sin = model._rotary_tables(torch.zeros(SEQ, 1, 1))
    h = model.decoder(model.embedding(tokens, None), rotary_pos_emb=cos_sin)  # [s, b, h]
    main = F.cross_entropy(
        (h @ out_w.t()).reshape(-1, VOCAB), labels.t().reshape(-1), reduction="none"
    )
    total = (main.view(SEQ, BATCH).t() * mask).sum()
    means = []
    for k in range(1, depths + 1):
        layer = model.mtp.layers[k - 1]
        e = F.embedding(_shift(tokens, k), emb).transpose(0, 1)
        x = torch.cat([_rms(e, layer.enorm.weight, eps), _rms(h, layer.hnorm.weight, eps)], -1)
        x = x @ layer.eh_proj.weight.t()
        x, _ = layer.transformer_layer(x, rotary_pos_emb=cos_sin)
        h = _rms(x, layer.final_layernorm.weight, eps)
        logits = (h @ out_w.t()).transpose(0, 1)
        ce = F.cross_entropy(
            logits.reshape(-1, VOCAB), _shift(labels, k).reshape(-1), reduction="none"
        )
        m = _shift(mask, k)
        means.append((ce.view(BATCH, SEQ) * m).sum() / m.sum())
    (total + scale * factor / depths * sum(means)).backward()
    for name, param in model.named_parameters():
        assert torch.allclose(got[name], param.grad, rtol=1e-10, atol=1e-12), (
            name,
            (got[name] - param.grad).abs().max(),
        )
    assert torch.allclose(tracked, torch.stack(means).float().detach(), rtol=1e-6)
    assert model.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0


def test_forward_output_is_the_main_heads():
    """MTP changes only backward: the returned losses and the logits are the model's without it."""
    model = _model(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    with_mtp = model(tokens, None, None, labels=labels)
    model.eval()
    assert torch.equal(with_mtp, model(tokens, None, None, labels=labels))


def test_flops_count_mtp_as_torch_counts_them():
    """--log-throughput's FLOPs with MTP (megatron/training/flops.py, Megatron's formula) equal
    torch.utils.flop_counter's count of one forward and backward of a tiny model with 2 depths,
    but for the MTP norms (6 * B * s * D * 3h, elementwise: not counted by torch)."""
    import argparse

    from torch.utils.flop_counter import FlopCounterMode

    from megatron.training.flops import num_floating_point_operations

    depths = 2
    model = _model(depths, ffn_hidden_size=48)
    model.set_mtp_loss_scale(1.0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(tokens, None, None, labels=tokens).sum().backward()
    args = argparse.Namespace(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        group_query_attention=False,
        num_query_groups=None,
        kv_channels=None,
        seq_length=SEQ,
        ffn_hidden_size=48,
        swiglu=False,
        padded_vocab_size=VOCAB,
        num_experts=None,
        mtp_num_layers=depths,
    )
    norms = 6 * BATCH * SEQ * depths * 3 * 32
    assert num_floating_point_operations(args, BATCH) - norms == counter.get_total_flops()
    args.mtp_num_layers = None
    without = num_floating_point_operations(args, BATCH)
    assert without < counter.get_total_flops()  # MTP is counted at all


def test_full_recompute_gives_the_same_gradients():
    """--recompute-granularity full --recompute-method uniform recomputes each MTP depth in
    backward: the same gradients, with the depths' activations not kept."""
    grads, calls = [], []
    for recompute in (None, "full"):
        extra = dict(recompute_method="uniform", recompute_num_layers=1) if recompute else {}
        model = _model(2, recompute_granularity=recompute, **extra)
        model.set_mtp_loss_scale(1.0)
        runs = []
        model.mtp.layers[0].register_forward_hook(lambda *_: runs.append(1))
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
        model(tokens, None, None, labels=tokens).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        calls.append(len(runs))
    assert calls == [1, 2]  # recomputed in backward
    for name, grad in grads[0].items():
        # float64: only the order of the gradient sums differs.
        assert torch.allclose(grad, grads[1][name], rtol=1e-12, atol=1e-14), name
