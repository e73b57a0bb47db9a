"""BertModel against a real peer (transformers' MegatronBertForPreTraining, Megatron's pre-norm
BERT), the weight conversion both ways, the padding mask and the model family's figures."""

import argparse
import importlib.util
import sys

import pytest
import torch
import transformers  # noqa: E402  (a dependency of the package)

from megatron.core.models.bert import BertModel
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.functional_tests.runner import REPO

_spec = importlib.util.spec_from_file_location(
    "hf_megatron_bert", REPO / "tools" / "checkpoint" / "hf_megatron_bert.py"
)
hf_megatron_bert = importlib.util.module_from_spec(_spec)
sys.modules["hf_megatron_bert"] = hf_megatron_bert
_spec.loader.exec_module(hf_megatron_bert)

VOCAB, HIDDEN, HEADS, LAYERS, FFN, MAXPOS = 96, 32, 4, 2, 48, 24


def _model(binary_head=True, seed=3):
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_seed=seed,
        init_method_std=0.2,  # large weights: a layout mistake cannot hide in small logits
    )
    model = BertModel(
        config,
        num_tokentypes=2 if binary_head else 0,
        transformer_layer_spec=bert_layer_local_spec,
        vocab_size=VOCAB,
        max_sequence_length=MAXPOS,
        share_embeddings_and_output_weights=True,
        add_binary_head=binary_head,
    )
    with torch.no_grad():  # non-trivial biases and norms
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _hf_model():
    config = transformers.MegatronBertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=MAXPOS,
        type_vocab_size=2,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.MegatronBertForPreTraining(config).eval()


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 20), generator=g)
    types = torch.zeros_like(ids)
    types[:, 9:] = 1
    padding = torch.ones_like(ids)
    padding[1, 14:] = 0
    padding[2, 7:] = 0
    return ids, types, padding


def test_logits_match_transformers_megatron_bert_both_ways():
    model = _model()
    hf = _hf_model()
    hf_state = hf_megatron_bert.core_to_hf(model.state_dict(), HEADS)
    missing, unexpected = hf.load_state_dict(hf_state, strict=False)
    # Only buffers transformers builds itself may be missing (position ids).
    assert all("position_ids" in k for k in missing) and not unexpected, (missing, unexpected)
    ids, types, padding = _inputs()
    with torch.no_grad():
        logits, binary = model(ids, padding, tokentype_ids=types)
        ref = hf(input_ids=ids, attention_mask=padding, token_type_ids=types)
    real = padding.bool()
    assert logits.shape == (3, 20, VOCAB) and binary.shape == (3, 2)
    assert ref.prediction_logits.abs().max() > 1.0  # a meaningful comparison
    torch.testing.assert_close(logits[real], ref.prediction_logits[real], rtol=0, atol=1e-4)
    torch.testing.assert_close(binary, ref.seq_relationship_logits, rtol=0, atol=1e-4)

    # Back: the converted state equals the original exactly, key for key.
    back = hf_megatron_bert.hf_to_core(hf.state_dict(), HEADS)
    original = model.state_dict()
    assert sorted(back) == sorted(original)
    for key, value in original.items():
        assert torch.equal(back[key], value), key


def test_hf_to_core_refuses_untied_decoder():
    state = hf_megatron_bert.core_to_hf(_model().state_dict(), HEADS)
    state["cls.predictions.decoder.weight"] = state["cls.predictions.decoder.weight"] + 1
    with pytest.raises(ValueError, match="decoder\\) weight differs from its word embedding"):
        hf_megatron_bert.hf_to_core(state, HEADS)


def test_pad_tokens_do_not_change_real_positions_and_loss_matches_logits():
    model = _model(binary_head=False)
    ids, _, padding = _inputs()
    other = ids.clone()
    other[padding == 0] = (other[padding == 0] + 7) % VOCAB
    with torch.no_grad():
        a, no_binary = model(ids, padding)
        b, _ = model(other, padding)
        losses, _ = model(ids, padding, lm_labels=ids)
    real = padding.bool()
    assert no_binary is None
    assert torch.equal(a[real], b[real])
    assert not torch.equal(a[~real], b[~real])  # the pad positions did see the change
    expected = torch.nn.functional.cross_entropy(
        a.reshape(-1, VOCAB).double(), ids.reshape(-1), reduction="none"
    ).view(ids.shape)
    torch.testing.assert_close(losses.double(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="the \\[b, s\\] padding mask"):
        model(ids, padding[:, None, None, :])


def test_bert_family_counts_the_model_parameters():
    from megatron.training.model_families import get_model_family

    family = get_model_family("bert")
    for binary in (True, False):
        args = argparse.Namespace(
            hidden_size=HIDDEN,
            ffn_hidden_size=FFN,
            num_attention_heads=HEADS,
            kv_channels=HIDDEN // HEADS,
            num_query_groups=HEADS,
            add_bias_linear=True,
            add_qkv_bias=True,
            swiglu=False,
            qk_layernorm=False,
            normalization="LayerNorm",
            position_embedding_type="learned_absolute",
            max_position_embeddings=MAXPOS,
            untie_embeddings_and_output_weights=False,
            num_layers=LAYERS,
            bert_binary_head=binary,
        )
        count = family.count_parameters(args, VOCAB)
        model = _model(binary_head=binary)
        assert count.total == sum(p.numel() for p in model.parameters())
        assert count.on_rank(1, 1, 0, LAYERS) == count.total
