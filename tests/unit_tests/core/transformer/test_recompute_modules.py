"""--recompute-modules moe_act, mla_up_proj, moe and shared_experts (selective recompute of a
submodule, megatron-core's definitions): training with each recomputed equals training without.

A tiny DeepSeek-style model (multi-latent attention with a q LoRA rank and QK norms, a dense
first layer, then MoE layers of gated experts with a shared expert; dropout on, so the
recomputation must replay the random streams) takes three optimizer steps. With each module
recomputed (and with all of Megatron's modules at once) the losses and the final parameters are
bit for bit those of the run without recompute: the recomputation repeats the same operations
(with 'layernorm', built before, the parameters are within 1e-5 after three Adam steps: its
gradients move by an ulp, see below).
The saved-tensor bytes after a forward drop by at least the activations each one frees.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.transformer_config import MLATransformerConfig

VOCAB, SEQ, BATCH, HIDDEN = 64, 16, 2, 32
EXPERTS, MOE_FFN = 4, 24
ALL_MODULES = ["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"]


def build(*modules, grouped=True):
    recompute = (
        dict(recompute_granularity="selective", recompute_modules=list(modules)) if modules else {}
    )
    config = MLATransformerConfig(
        num_layers=3,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=48,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=8,
        qk_layernorm=True,
        rope_type="rope",
        num_moe_experts=EXPERTS,
        moe_layer_freq=[0, 1, 1],
        moe_ffn_hidden_size=MOE_FFN,
        moe_shared_expert_intermediate_size=MOE_FFN,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=grouped,
        moe_aux_loss_coeff=1e-2,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        params_dtype=torch.float32,
        init_seed=5,
        **recompute,
    )
    model = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    return model.train()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
    )


def train(model, steps=3):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens, labels = batch(step)
        torch.manual_seed(step)  # the dropout masks
        loss = model(tokens, None, None, labels=labels).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return train(build())


@pytest.mark.parametrize(
    "modules",
    [("moe_act",), ("mla_up_proj",), ("moe",), ("shared_experts",), ("core_attn", "mlp")],
    ids=["moe_act", "mla_up_proj", "moe", "shared_experts", "core_attn_mlp"],
)
def test_training_with_the_module_recomputed_is_bitwise_the_same(modules, reference):
    ref_losses, ref_params = reference
    losses, params = train(build(*modules))
    assert torch.equal(losses, ref_losses), (losses, ref_losses)
    for name, param in params.items():
        assert torch.equal(param, ref_params[name]), name


def test_all_modules_recomputed_add_nothing_to_layernorm_recompute(reference):
    """'layernorm' (built before) moves float sums in backward by an ulp on this model (its
    recomputed norm's input gradient joins the residual's in another order: gradients within
    5e-7 relative, the same losses); every other module on top of it changes no bit."""
    ref_losses, ref_params = reference
    norm_losses, norm_params = train(build("layernorm"))
    losses, params = train(build(*ALL_MODULES))
    assert torch.equal(losses, norm_losses) and torch.equal(losses, ref_losses)
    for name, param in params.items():
        assert torch.equal(param, norm_params[name]), name
        torch.testing.assert_close(param, ref_params[name], rtol=0, atol=1e-5)


def test_moe_act_recompute_with_per_expert_gemms():
    # The sequential experts (no --moe-grouped-gemm) checkpoint each expert's activation.
    ref_losses, ref_params = train(build(grouped=False), steps=2)
    losses, params = train(build("moe_act", grouped=False), steps=2)
    assert torch.equal(losses, ref_losses)
    for name, param in params.items():
        assert torch.equal(param, ref_params[name]), name


def held_bytes_after_forward(model) -> int:
    """Bytes of the distinct, still allocated storages autograd holds for backward once the
    forward is done (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []
    tokens, labels = batch(0)
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(tokens, None, None, labels=labels).mean()
    held = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0 and storage.data_ptr() not in params:
            held[storage.data_ptr()] = storage.nbytes()
    loss.backward()
    return sum(held.values())


def test_recompute_frees_saved_activations():
    plain = held_bytes_after_forward(build())
    tokens = SEQ * BATCH
    # moe_act: the activation output [routed tokens, moe_ffn] of the two MoE layers.
    moe_act = plain - held_bytes_after_forward(build("moe_act"))
    assert moe_act >= 2 * tokens * 2 * MOE_FFN * 4, (plain, moe_act)
    # mla_up_proj: at least the per-head keys (k_nope) of the three layers' up projections.
    up_proj = plain - held_bytes_after_forward(build("mla_up_proj"))
    assert up_proj >= 3 * tokens * 4 * 8 * 4, (plain, up_proj)
    # shared_experts: at least the shared experts' intermediate [tokens, 2 * ffn].
    shared = plain - held_bytes_after_forward(build("shared_experts"))
    assert shared >= 2 * tokens * 2 * MOE_FFN * 4, (plain, shared)


def test_mla_up_proj_needs_multi_latent_attention():
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError, match=r"'mla_up_proj' \(--recompute-modules\) needs"):
        TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=4,
            recompute_granularity="selective",
            recompute_modules=["mla_up_proj"],
        )
