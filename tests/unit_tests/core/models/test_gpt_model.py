"""GPTModel: parameter names/shapes, init, loss, an independent float64 reference forward, and
properties (causality, dropout, determinism, recompute, pipeline slices)."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.common.language_module import language_model_cross_entropy
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.utils import squared_relu
from tests.unit_tests.tiny_configs import TINY_SEQ, TINY_VOCAB
from tests.unit_tests.tiny_configs import tiny_gpt_model as make_model
from tests.unit_tests.tiny_configs import tiny_transformer_config as make_config

VOCAB, SEQ = TINY_VOCAB, TINY_SEQ


pytestmark = pytest.mark.usefixtures("single_thread")


def batch(b=2, s=SEQ, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, s), generator=g)
    labels = torch.randint(0, VOCAB, (b, s), generator=g)
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    return tokens, position_ids, labels


def shapes(model):
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------- parameter names


def test_names_learned_absolute_layernorm_gelu_biases():
    model = make_model(config=make_config(num_layers=2), share_embeddings_and_output_weights=True)
    h, ffn = 32, 128
    expected = {
        "embedding.word_embeddings.weight": (VOCAB, h),
        "embedding.position_embeddings.weight": (SEQ, h),
        "decoder.final_layernorm.weight": (h,),
        "decoder.final_layernorm.bias": (h,),
    }
    for n in range(2):
        p = f"decoder.layers.{n}."
        expected.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "input_layernorm.bias": (h,),
                p + "self_attention.linear_qkv.weight": (3 * h, h),
                p + "self_attention.linear_qkv.bias": (3 * h,),
                p + "self_attention.linear_proj.weight": (h, h),
                p + "self_attention.linear_proj.bias": (h,),
                p + "pre_mlp_layernorm.weight": (h,),
                p + "pre_mlp_layernorm.bias": (h,),
                p + "mlp.linear_fc1.weight": (ffn, h),
                p + "mlp.linear_fc1.bias": (ffn,),
                p + "mlp.linear_fc2.weight": (h, ffn),
                p + "mlp.linear_fc2.bias": (h,),
            }
        )
    assert shapes(model) == expected
    assert set(model.state_dict()) == set(expected)  # tied: no output_layer.weight anywhere
    for param in model.parameters():
        assert param.tensor_model_parallel is False
        assert not hasattr(param, "shared")  # PP=1: no shared marker


def test_names_rope_rmsnorm_swiglu_gqa_no_bias_untied():
    config = make_config(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        ffn_hidden_size=48,
    )
    model = make_model(config=config, position_embedding_type="rope")
    d = 8
    p = "decoder.layers.0."
    assert shapes(model) == {
        "embedding.word_embeddings.weight": (VOCAB, 32),
        p + "input_layernorm.weight": (32,),
        p + "self_attention.linear_qkv.weight": ((4 + 2 * 2) * d, 32),
        p + "self_attention.linear_proj.weight": (32, 4 * d),
        p + "pre_mlp_layernorm.weight": (32,),
        p + "mlp.linear_fc1.weight": (2 * 48, 32),
        p + "mlp.linear_fc2.weight": (32, 48),
        "decoder.final_layernorm.weight": (32,),
        "output_layer.weight": (VOCAB, 32),
    }
    assert model.output_layer.weight.is_embedding_or_output_parameter
    assert model.embedding.word_embeddings.weight.is_embedding_or_output_parameter


def test_names_qk_layernorm_and_qkv_bias_only():
    config = make_config(
        num_layers=1, qk_layernorm=True, add_bias_linear=False, add_qkv_bias=True, kv_channels=16
    )
    model = make_model(config=config, position_embedding_type="none")
    p = "decoder.layers.0.self_attention."
    s = shapes(model)
    assert s[p + "q_layernorm.weight"] == (16,) and s[p + "q_layernorm.bias"] == (16,)
    assert s[p + "k_layernorm.weight"] == (16,) and s[p + "k_layernorm.bias"] == (16,)
    assert s[p + "linear_qkv.weight"] == (3 * 4 * 16, 32) and s[p + "linear_qkv.bias"] == (
        3 * 4 * 16,
    )
    assert s[p + "linear_proj.weight"] == (32, 64)
    assert p + "linear_proj.bias" not in s
    assert "decoder.layers.0.mlp.linear_fc1.bias" not in s
    assert "embedding.position_embeddings.weight" not in s


# ----------------------------------------------------------------------------- shapes and loss


def test_forward_shapes_and_loss_matches_cross_entropy():
    model = make_model(position_embedding_type="rope")
    tokens, pos, labels = batch(b=3)
    logits = model(tokens, pos, None)
    assert logits.shape == (3, SEQ, VOCAB) and logits.dtype == torch.float32
    losses = model(tokens, pos, None, labels=labels)
    assert losses.shape == (3, SEQ) and losses.dtype == torch.float32
    expected = F.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
    ).view(3, SEQ)
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)


def test_fused_cross_entropy_gradient_matches_torch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, 11, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 11, (5, 7), generator=g)
    weights = torch.rand(5, 7, dtype=torch.float64, generator=g)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    loss_a = language_model_cross_entropy(a, labels)
    loss_b = F.cross_entropy(b.view(-1, 11), labels.view(-1), reduction="none").view(5, 7)
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=1e-12)
    (loss_a * weights).sum().backward()
    (loss_b * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    # The backward reuses its saved buffer in place: a second pass fails loudly, never silently.
    c = logits.clone().requires_grad_()
    loss_c = language_model_cross_entropy(c, labels).sum()
    loss_c.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss_c.backward()


def test_labels_must_be_passed_by_keyword():
    model = make_model()
    tokens, pos, labels = batch()
    with pytest.raises(ValueError, match="labels by keyword"):
        model(tokens, pos, None, labels)


def test_loss_backward_reaches_every_parameter():
    model = make_model(config=make_config(qk_layernorm=True), position_embedding_type="rope")
    tokens, pos, labels = batch()
    model(tokens, pos, None, labels=labels).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


# ----------------------------------------------------------------------------- reference forward


def _ref_norm(x, sd, prefix, cfg):
    w = sd[prefix + ".weight"]
    if cfg.layernorm_zero_centered_gamma:
        w = 1.0 + w
    eps = cfg.layernorm_epsilon
    if cfg.normalization == "RMSNorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + sd[prefix + ".bias"]


def _textbook_inv_freq(rot, base, llama3_factor=None):
    """theta_i = base^(-2i/rot), optionally with Llama 3.1's published frequency scaling."""
    freqs = []
    for i in range(rot // 2):
        f = base ** (-2.0 * i / rot)
        if llama3_factor is not None:
            low, high, orig = 1.0, 4.0, 8192.0
            wavelen = 2 * math.pi / f
            if wavelen < orig / high:
                pass
            elif wavelen > orig / low:
                f = f / llama3_factor
            else:
                smooth = (orig / wavelen - low) / (high - low)
                f = (1 - smooth) * f / llama3_factor + smooth * f
        freqs.append(f)
    return freqs


def _textbook_rope(x, rot, base, interleaved, llama3_factor=None):
    """Rotate each pair of dims of x [b, s, heads, d] by position * theta_i (2x2 rotations)."""
    out = x.clone()
    s = x.shape[1]
    for i, theta in enumerate(_textbook_inv_freq(rot, base, llama3_factor)):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + rot // 2)
        for m in range(s):
            c, sn = math.cos(m * theta), math.sin(m * theta)
            xa, xb = x[:, m, :, a], x[:, m, :, b]
            out[:, m, :, a] = xa * c - xb * sn
            out[:, m, :, b] = xa * sn + xb * c
    return out


def reference_logits(
    model, cfg, tokens, position_ids, attention_mask=None, rope=None, tied=False, gelu_tanh=False
):
    """Plain float64 forward written from the model's state dict, independent of its code."""
    sd = {k: v.detach().double() for k, v in model.state_dict().items()}
    b, s = tokens.shape
    nh, ng, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    npg = nh // ng
    x = sd["embedding.word_embeddings.weight"][tokens]
    if "embedding.position_embeddings.weight" in sd:
        x = x + sd["embedding.position_embeddings.weight"][position_ids]
    if attention_mask is None:
        allowed = torch.ones(s, s, dtype=torch.bool).tril().expand(b, s, s)
    else:
        allowed = ~attention_mask[:, 0]
    for layer in range(cfg.num_layers):
        p = f"decoder.layers.{layer}."
        y = _ref_norm(x, sd, p + "input_layernorm", cfg)
        qkv = y @ sd[p + "self_attention.linear_qkv.weight"].T
        if p + "self_attention.linear_qkv.bias" in sd:
            qkv = qkv + sd[p + "self_attention.linear_qkv.bias"]
        q = torch.zeros(b, s, nh, d, dtype=torch.float64)
        k = torch.zeros(b, s, ng, d, dtype=torch.float64)
        v = torch.zeros(b, s, ng, d, dtype=torch.float64)
        for g in range(ng):
            base = g * (npg + 2) * d
            for j in range(npg):
                q[:, :, g * npg + j] = qkv[..., base + j * d : base + (j + 1) * d]
            k[:, :, g] = qkv[..., base + npg * d : base + (npg + 1) * d]
            v[:, :, g] = qkv[..., base + (npg + 1) * d : base + (npg + 2) * d]
        if cfg.qk_layernorm:
            q = _ref_norm(q, sd, p + "self_attention.q_layernorm", cfg)
            k = _ref_norm(k, sd, p + "self_attention.k_layernorm", cfg)
        if rope is not None:
            q = _textbook_rope(q, **rope)
            k = _textbook_rope(k, **rope)
        ctx = torch.zeros(b, s, nh, d, dtype=torch.float64)
        for head in range(nh):
            kv_head = head // npg
            scores = q[:, :, head] @ k[:, :, kv_head].transpose(1, 2) / math.sqrt(d)
            scores = scores.masked_fill(~allowed, float("-inf"))
            ctx[:, :, head] = torch.softmax(scores, dim=-1) @ v[:, :, kv_head]
        attn = ctx.reshape(b, s, nh * d) @ sd[p + "self_attention.linear_proj.weight"].T
        if p + "self_attention.linear_proj.bias" in sd:
            attn = attn + sd[p + "self_attention.linear_proj.bias"]
        residual = y if cfg.apply_residual_connection_post_layernorm else x
        x = residual + attn
        y = _ref_norm(x, sd, p + "pre_mlp_layernorm", cfg)
        hmid = y @ sd[p + "mlp.linear_fc1.weight"].T
        if p + "mlp.linear_fc1.bias" in sd:
            hmid = hmid + sd[p + "mlp.linear_fc1.bias"]
        if cfg.gated_linear_unit:
            ffn = hmid.shape[-1] // 2
            gate, up = hmid[..., :ffn], hmid[..., ffn:]
            hmid = gate * torch.sigmoid(gate) * up  # SwiGLU: silu(gate) * up
        elif cfg.activation_func is squared_relu:
            hmid = torch.clamp(hmid, min=0) ** 2
        elif gelu_tanh:
            hmid = (
                0.5 * hmid * (1 + torch.tanh(math.sqrt(2 / math.pi) * (hmid + 0.044715 * hmid**3)))
            )
        else:
            hmid = 0.5 * hmid * (1 + torch.erf(hmid / math.sqrt(2)))
        mlp = hmid @ sd[p + "mlp.linear_fc2.weight"].T
        if p + "mlp.linear_fc2.bias" in sd:
            mlp = mlp + sd[p + "mlp.linear_fc2.bias"]
        residual = y if cfg.apply_residual_connection_post_layernorm else x
        x = residual + mlp
    x = _ref_norm(x, sd, "decoder.final_layernorm", cfg)
    out_w = sd["embedding.word_embeddings.weight"] if tied else sd["output_layer.weight"]
    return x @ out_w.T


def _perturb(model, seed=5):
    """Give biases and norm weights non-trivial values so the reference checks them too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, dtype=p.dtype, generator=g) * 0.1)


REFERENCE_CASES = {
    "gpt2_learned_layernorm_gelu_tied": (
        dict(),
        dict(share_embeddings_and_output_weights=True),
        None,
        False,
    ),
    "llama_rope_rmsnorm_swiglu_gqa": (
        dict(
            num_attention_heads=4,
            num_query_groups=2,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            ffn_hidden_size=40,
        ),
        dict(position_embedding_type="rope", rotary_base=500),
        dict(rot=8, base=500, interleaved=False),
        False,
    ),
    "mqa_partial_interleaved_rope_qknorm_1p_llama3": (
        dict(
            num_attention_heads=4,
            num_query_groups=1,
            kv_channels=12,
            qk_layernorm=True,
            layernorm_zero_centered_gamma=True,
            add_bias_linear=False,
            add_qkv_bias=True,
        ),
        dict(
            position_embedding_type="rope",
            rotary_percent=0.5,
            rope_scaling=True,
            rope_scaling_factor=8.0,
            rotary_base=1e6,
        ),
        dict(rot=6, base=1e6, interleaved=True, llama3_factor=8.0),
        False,
    ),
    "post_ln_residual_squared_relu_no_pos": (
        dict(apply_residual_connection_post_layernorm=True, activation_func=squared_relu),
        dict(position_embedding_type="none"),
        None,
        False,
    ),
    "fused_bias_gelu_is_tanh": (dict(bias_activation_fusion=True), dict(), None, True),
}


@pytest.mark.parametrize("case", sorted(REFERENCE_CASES))
def test_matches_float64_reference(case):
    cfg_kw, model_kw, rope, gelu_tanh = REFERENCE_CASES[case]
    if "rotary_interleaved" not in cfg_kw and rope is not None:
        cfg_kw = dict(cfg_kw, rotary_interleaved=rope["interleaved"])
    cfg = make_config(params_dtype=torch.float64, **cfg_kw)
    model = make_model(config=cfg, **model_kw)
    _perturb(model)
    tokens, pos, _ = batch(b=2)
    logits = model(tokens, pos, None)
    expected = reference_logits(
        model,
        cfg,
        tokens,
        pos,
        rope=rope,
        gelu_tanh=gelu_tanh,
        tied=model_kw.get("share_embeddings_and_output_weights", False),
    )
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)


def test_explicit_document_mask_matches_reference():
    cfg = make_config(params_dtype=torch.float64, num_query_groups=2)
    model = make_model(config=cfg, position_embedding_type="rope")
    _perturb(model)
    tokens, pos, _ = batch(b=2)
    # Two documents per row (reset-attention-mask): no attention across the boundary.
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).repeat(2, 1, 1, 1)
    mask[0, 0, 5:, :5] = True
    mask[1, 0, 8:, :8] = True
    logits = model(tokens, pos, mask)
    expected = reference_logits(
        model,
        cfg,
        tokens,
        pos,
        attention_mask=mask,
        rope=dict(rot=8, base=10000, interleaved=False),
    )
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)
    # An explicit causal mask gives the same result as None (the fast is_causal path).
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(2, 1, SEQ, SEQ)
    torch.testing.assert_close(
        model(tokens, pos, causal), model(tokens, pos, None), rtol=0, atol=1e-12
    )


def test_rejects_non_bool_mask():
    model = make_model()
    tokens, pos, _ = batch()
    with pytest.raises(ValueError, match="bool"):
        model(tokens, pos, torch.zeros(2, 1, SEQ, SEQ))


# ----------------------------------------------------------------------------- init


def test_init_statistics():
    cfg = make_config(num_layers=4, hidden_size=128, num_attention_heads=4, init_method_std=0.05)
    model = make_model(config=cfg, vocab_size=500, max_sequence_length=64)
    params = dict(model.named_parameters())
    scaled = 0.05 / math.sqrt(2 * 4)
    stds = {
        "embedding.word_embeddings.weight": 0.05,
        "embedding.position_embeddings.weight": 0.05,
        "output_layer.weight": 0.05,
        "decoder.layers.1.self_attention.linear_qkv.weight": 0.05,
        "decoder.layers.1.mlp.linear_fc1.weight": 0.05,
        "decoder.layers.1.self_attention.linear_proj.weight": scaled,
        "decoder.layers.1.mlp.linear_fc2.weight": scaled,
    }
    for name, std in stds.items():
        w = params[name].detach()
        # >= 16k samples each: the sample std is within ~1 % of the truth; 5 % is a loose bound
        # that still separates 0.05 from 0.05/sqrt(8).
        assert abs(w.std().item() / std - 1) < 0.05, name
        assert abs(w.mean().item()) < 4 * std / math.sqrt(w.numel()), name
    for name, p in params.items():
        if name.endswith(".bias"):
            assert torch.all(p == 0), name
        if "layernorm" in name and name.endswith(".weight"):
            assert torch.all(p == 1), name


def test_zero_centered_gamma_init_and_meta_and_no_init():
    cfg = make_config(layernorm_zero_centered_gamma=True, normalization="RMSNorm")
    model = make_model(config=cfg)
    assert torch.all(model.decoder.final_layernorm.weight == 0)
    meta = make_model(config=make_config(init_model_with_meta_device=True))
    assert all(p.device.type == "meta" for p in meta.parameters())
    uninit = make_model(config=make_config(perform_initialization=False))
    assert shapes(uninit) == shapes(make_model())


def test_params_dtype():
    model = make_model(config=make_config(params_dtype=torch.bfloat16, bf16=True))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ref = make_model(config=make_config())
    # Drawn in fp32 then rounded: the same values up to bf16 rounding.
    w16 = model.decoder.layers[0].mlp.linear_fc1.weight.float()
    w32 = ref.decoder.layers[0].mlp.linear_fc1.weight
    torch.testing.assert_close(w16, w32, rtol=1e-2, atol=1e-4)


def test_same_seed_same_params_other_seed_differs():
    a = make_model(seed=7, position_embedding_type="rope").state_dict()
    b = make_model(seed=7, position_embedding_type="rope").state_dict()
    c = make_model(seed=8, position_embedding_type="rope").state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["decoder.layers.0.mlp.linear_fc1.weight"], c["decoder.layers.0.mlp.linear_fc1.weight"]
    )


# ----------------------------------------------------------------------------- properties


def test_dropout_only_in_train_mode():
    model = make_model(config=make_config(hidden_dropout=0.3, attention_dropout=0.3))
    tokens, pos, _ = batch()
    model.eval()
    e1, e2 = model(tokens, pos, None), model(tokens, pos, None)
    assert torch.equal(e1, e2)
    model.train()
    t1, t2 = model(tokens, pos, None), model(tokens, pos, None)
    assert not torch.allclose(t1, t2)
    assert not torch.allclose(t1, e1)
    no_drop = make_model(config=make_config())
    no_drop.train()
    out_train = no_drop(tokens, pos, None)
    no_drop.eval()
    assert torch.equal(out_train, no_drop(tokens, pos, None))


@pytest.mark.parametrize("pe", ["learned_absolute", "rope"])
def test_causal_later_tokens_do_not_change_earlier_logits(pe):
    model = make_model(
        config=make_config(params_dtype=torch.float64, num_query_groups=2),
        position_embedding_type=pe,
    )
    tokens, pos, _ = batch(b=1)
    base = model(tokens, pos, None)
    changed = tokens.clone()
    changed[0, 7] = (changed[0, 7] + 1) % VOCAB
    out = model(changed, pos, None)
    torch.testing.assert_close(out[:, :7], base[:, :7], rtol=0, atol=1e-12)
    assert not torch.allclose(out[:, 7:], base[:, 7:])


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
    ],
)
def test_recompute_gives_identical_loss_and_grads(recompute):
    dropout = dict(hidden_dropout=0.2, attention_dropout=0.2, num_layers=3)
    plain = make_model(seed=3, config=make_config(**dropout), position_embedding_type="rope")
    again = make_model(
        seed=3, config=make_config(**dropout, **recompute), position_embedding_type="rope"
    )
    tokens, pos, labels = batch()
    results = []
    for model in (plain, again):
        model.train()
        torch.manual_seed(11)
        loss = model(tokens, pos, None, labels=labels).sum()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-6)
    for name in results[0][1]:
        torch.testing.assert_close(results[0][1][name], results[1][1][name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tied", [False, True])
def test_two_pipeline_stages_reproduce_the_full_model(tied):
    cfg = make_config(num_layers=3, params_dtype=torch.float64)
    full = make_model(
        config=cfg, position_embedding_type="rope", share_embeddings_and_output_weights=tied
    )
    first = GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        VOCAB,
        SEQ,
        pre_process=True,
        post_process=False,
        num_layers=2,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
    )
    last = GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        VOCAB,
        SEQ,
        pre_process=False,
        post_process=True,
        num_layers=1,
        layer_number_offset=2,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
    )
    assert [layer.layer_number for layer in last.decoder.layers] == [3]
    assert not hasattr(first.decoder, "final_layernorm") or first.decoder.final_layernorm is None
    if tied:
        assert last.output_layer.weight.shared and torch.all(last.output_layer.weight == 0)
        assert first.embedding.word_embeddings.weight.shared_embedding
    sd = full.state_dict()
    first.load_state_dict(
        {
            k: v
            for k, v in sd.items()
            if k.startswith("embedding.")
            or k.startswith("decoder.layers.0.")
            or k.startswith("decoder.layers.1.")
        }
    )
    last_sd = {
        k.replace("decoder.layers.2.", "decoder.layers.0."): v
        for k, v in sd.items()
        if k.startswith("decoder.layers.2.") or k.startswith("decoder.final_layernorm")
    }
    last_sd["output_layer.weight"] = sd[
        "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    ]
    last.load_state_dict(last_sd)
    tokens, pos, labels = batch()
    hidden = first(tokens, pos, None)
    assert hidden.shape == (SEQ, 2, 32)
    last.set_input_tensor([hidden])
    torch.testing.assert_close(
        last(None, None, None, labels=labels),
        full(tokens, pos, None, labels=labels),
        rtol=0,
        atol=1e-12,
    )


def test_float16_module_computes_in_bf16_and_returns_fp32():
    cfg = make_config(bf16=True, params_dtype=torch.bfloat16, fp32_residual_connection=True)
    torch.manual_seed(0)
    model = Float16Module(
        cfg, GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope")
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(not k.startswith("module.") for k in model.state_dict())
    # Reference: the same (bf16-valued) weights in a float64 model.
    reference = GPTModel(
        make_config(params_dtype=torch.float64),
        get_gpt_layer_local_spec(),
        VOCAB,
        SEQ,
        position_embedding_type="rope",
    )
    reference.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    tokens, pos, labels = batch()
    losses = model(tokens, pos, None, labels=labels)
    expected = reference(tokens, pos, None, labels=labels)
    assert losses.dtype == torch.float32 and losses.shape == expected.shape
    torch.testing.assert_close(losses.double(), expected.double(), rtol=1e-2, atol=0)
    logits = model(tokens, pos, None)
    assert logits.dtype == torch.float32
    reference_logits = reference(tokens, pos, None)
    # bf16 keeps 8 significant bits: logits off by parts per thousand (measured 3.4e-3 of the
    # largest). float32 arithmetic on the same weights stays near 1e-7, so the lower bound
    # shows that the forward ran in bf16.
    error = (logits.double() - reference_logits).abs().max() / reference_logits.abs().max()
    assert 1e-4 < error.item() < 3e-2, error
    losses.sum().backward()
    expected.sum().backward()
    grad = model.module.embedding.word_embeddings.weight.grad
    reference_grad = reference.embedding.word_embeddings.weight.grad
    assert grad.dtype == torch.bfloat16
    cosine = F.cosine_similarity(grad.double().flatten(), reference_grad.flatten(), dim=0)
    assert cosine > 0.999, cosine


def test_rejects_unsupported_options():
    with pytest.raises(ValueError, match="position_embedding_type"):
        make_model(position_embedding_type="yarn")
    with pytest.raises(ValueError, match="moe-router-topk"):
        make_model(config=make_config(num_moe_experts=4, moe_router_topk=5))
    with pytest.raises(ValueError, match="tensor-model-parallel-size"):
        make_model(config=make_config(tensor_model_parallel_size=2))


def test_small_model_learns_a_repeating_sequence():
    cfg = make_config(
        num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu
    )
    model = make_model(config=cfg, position_embedding_type="rope")
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, VOCAB, (5,), generator=g)
    seq = pattern.repeat(4)[: SEQ + 1]
    tokens, labels = seq[:-1].unsqueeze(0).repeat(4, 1), seq[1:].unsqueeze(0).repeat(4, 1)
    pos = torch.arange(SEQ).expand(4, SEQ)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(25):
        loss = model(tokens, pos, None, labels=labels).mean()
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first > 3.5  # ~log(61) at init
    assert loss.item() < 0.5 * first
