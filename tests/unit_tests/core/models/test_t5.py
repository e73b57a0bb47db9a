"""T5: span corruption on hand-worked input, span lengths against the geometric distribution
(chi-square bound stated), samples of the shipped corpus decode back to their text, and the
model's refusal of pipeline parallelism, its parameter count, and its logits against a float64
reference written out from the weights."""

import argparse
import dataclasses

import numpy as np
import pytest
import torch

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masked_dataset import create_masked_lm_predictions
from megatron.core.datasets.t5_dataset import (
    T5MaskedWordPieceDataset,
    T5MaskedWordPieceDatasetConfig,
    span_corruption,
)
from megatron.core.datasets.utils import Split
from megatron.core.models.T5 import T5Model
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_layer_local_spec,
    get_t5_encoder_layer_local_spec,
)
from megatron.core.tokenizers.bert_wordpiece import BertWordPieceLowerCase
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.core.datasets.test_bert_dataset import VOCAB


def test_span_corruption_on_hand_worked_input():
    tokens = [10, 11, 12, 13, 14, 15]
    enc, dec, labels = span_corruption(tokens, [[1, 2], [4]], [100, 101, 102], bos=7, eos=8)
    assert enc == [10, 100, 13, 101, 15]
    assert dec == [7, 100, 11, 12, 101, 14]
    assert labels == [100, 11, 12, 101, 14, 8]
    # A span at the start and one at the end; no span: the encoder sees everything.
    enc, dec, labels = span_corruption(tokens, [[0], [5]], [100, 101], bos=7, eos=8)
    assert (enc, dec, labels) == (
        [100, 11, 12, 13, 14, 101],
        [7, 100, 10, 101, 15],
        [100, 10, 101, 15, 8],
    )
    assert span_corruption(tokens, [], [100], 7, 8) == (tokens, [7], [8])


def test_first_span_length_is_geometric():
    """The first span chosen in a sample has min(Geometric(0.2), 10) words when neither the
    budget (15 % of 150 = 22 tokens) nor the end of the sample cuts it: spans starting in the
    first 140 tokens are kept (the start is drawn independently of the length). Chi-square over
    the 10 lengths, 9 degrees of freedom: the statistic must stay below 27.88 (p = 0.001)."""
    config = T5MaskedWordPieceDatasetConfig.__new__(T5MaskedWordPieceDatasetConfig)
    config.masking_probability = 0.15
    config.masking_max_ngram = 10
    config.masking_do_full_word = True
    config.masking_use_longer_ngrams = False
    config.masking_use_geometric_distribution = True
    tokens = list(range(1000, 1150))
    counts = np.zeros(11)
    for seed in range(1500):
        result = create_masked_lm_predictions(
            tokens, 150, np.random.RandomState(seed), config, (), lambda t: True, lambda r: 0
        )
        first = result.spans_in_draw_order[0]
        if first[0] < 140:
            counts[len(first)] += 1
    n = counts.sum()
    assert n > 1300
    probs = np.array([0.2 * 0.8 ** (k - 1) for k in range(1, 10)] + [0.8**9])
    expected = n * probs
    chi2 = float((((counts[1:] - expected) ** 2) / expected).sum())
    assert chi2 < 27.88, (counts, expected, chi2)
    # 15 % of the tokens are masked here (whole-word spans of single-piece words).
    assert sum(len(s) for s in result.spans) == 22


@pytest.fixture(scope="module")
def t5_dataset(bert_corpus):
    tokenizer = BertWordPieceLowerCase(VOCAB, vocab_extra_ids=100)
    config = T5MaskedWordPieceDatasetConfig(
        random_seed=5,
        sequence_length=64,
        sequence_length_decoder=32,
        tokenizer=tokenizer,
        split="1,0,0",
        masking_max_ngram=10,
        masking_use_geometric_distribution=True,
    )
    low = IndexedDataset(bert_corpus)
    docs = np.arange(low.document_indices.shape[0] - 1, dtype=np.int32)
    return T5MaskedWordPieceDataset(low, None, docs, 200, Split.train, config), low, tokenizer


def test_samples_restore_their_sentences(t5_dataset):
    ds, low, tokenizer = t5_dataset
    sentinels = tokenizer.additional_special_tokens_ids
    for idx in range(100):
        sample = ds[idx]
        first, end, target = (int(v) for v in ds.sample_index[idx])
        original = [int(t) for i in range(first, end) for t in low[i]][:target]
        n_enc, n_dec = int(sample["enc_mask"].sum()), int(sample["dec_mask"].sum())
        enc = sample["text_enc"][:n_enc].tolist()
        dec = sample["text_dec"][:n_dec].tolist()
        labels = sample["labels"][:n_dec].tolist()
        assert (sample["text_enc"][n_enc:] == tokenizer.pad).all()
        assert (sample["labels"][n_dec:] == -1).all()
        assert sample["loss_mask"].tolist() == [1] * n_dec + [0] * (32 - n_dec)
        # Teacher forcing: the decoder input is [BOS] + the labels shifted; the labels end in EOS.
        assert dec[0] == tokenizer.bos and dec[1:] == labels[:-1] and labels[-1] == tokenizer.eos
        used = [t for t in enc if t in sentinels]
        assert used == sentinels[: len(used)] and len(used) >= 1
        # Put each span (read from the labels) back in place of its sentinel.
        spans, current = {}, None
        for token in labels[:-1]:
            if token in sentinels:
                current = token
                spans[current] = []
            else:
                spans[current].append(token)
        restored = [t for token in enc for t in (spans[token] if token in sentinels else [token])]
        assert restored == original
        masked = sum(len(s) for s in spans.values())
        assert masked <= 0.15 * target + 1e-9


def _t5_config(**overrides):
    fields = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_seed=1,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def test_t5_refuses_pipeline_parallelism_like_megatron():
    config = _t5_config(pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="^Pipeline parallelism is not supported for T5.$"):
        T5Model(
            config,
            config,
            get_t5_encoder_layer_local_spec(),
            get_t5_decoder_layer_local_spec(),
            vocab_size=64,
            max_sequence_length=16,
        )


def test_t5_family_counts_the_parameters_and_the_decoder_reads_the_encoder():
    from megatron.training.model_families import get_model_family

    config = _t5_config()
    encoder_config = dataclasses.replace(config, num_layers=3)
    model = T5Model(
        config,
        encoder_config,
        get_t5_encoder_layer_local_spec(),
        get_t5_decoder_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
        share_embeddings_and_output_weights=True,
    )
    args = argparse.Namespace(
        hidden_size=32,
        ffn_hidden_size=128,
        num_attention_heads=4,
        kv_channels=8,
        num_query_groups=4,
        add_bias_linear=True,
        add_qkv_bias=True,
        swiglu=False,
        qk_layernorm=False,
        normalization="LayerNorm",
        position_embedding_type="learned_absolute",
        max_position_embeddings=16,
        untie_embeddings_and_output_weights=False,
        num_layers=3,
        encoder_num_layers=3,
        decoder_num_layers=2,
    )
    count = get_model_family("t5").count_parameters(args, 64)
    assert count.total == sum(p.numel() for p in model.parameters())

    # The decoder reads the encoder through the cross-attention: a real encoder token changes
    # the logits, an encoder pad does not.
    model.eval()
    g = torch.Generator().manual_seed(0)
    enc = torch.randint(0, 64, (2, 12), generator=g)
    dec = torch.randint(0, 64, (2, 6), generator=g)
    padding = torch.ones_like(enc)
    padding[:, 9:] = 0
    with torch.no_grad():
        base = model(enc, dec, padding)
        changed_pad, changed_real = enc.clone(), enc.clone()
        changed_pad[:, 10] = (enc[:, 10] + 1) % 64
        changed_real[:, 3] = (enc[:, 3] + 1) % 64
        assert torch.equal(model(changed_pad, dec, padding), base)
        assert (model(changed_real, dec, padding) - base).abs().max() > 1e-4


def _reference_t5_logits(model, enc, dec, padding, heads):
    """T5 written out in float64 from the model's weights (Megatron's layouts: per head q, k, v
    rows in linear_qkv, per head k, v rows in linear_kv; pre-norm layers; exact GeLU)."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    h = sd["embedding.word_embeddings.weight"].shape[1]
    d = h // heads

    def ln(x, p):
        return torch.nn.functional.layer_norm(x, (h,), sd[p + ".weight"], sd[p + ".bias"], 1e-5)

    def lin(x, p):
        return x @ sd[p + ".weight"].T + sd[p + ".bias"]

    def attention(q, k, v, masked):  # [b, s, heads, d]; masked [b or 1, sq, sk], True = masked
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / d**0.5
        scores = scores.masked_fill(masked[:, None], float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        return out.reshape(*out.shape[:2], h)

    def embed(ids):
        positions = sd["embedding.position_embeddings.weight"][: ids.shape[1]]
        return sd["embedding.word_embeddings.weight"][ids] + positions

    def layer(x, p, self_mask, context=None, context_mask=None):
        b, s, _ = x.shape
        qkv = lin(ln(x, p + "input_layernorm"), p + "self_attention.linear_qkv")
        q, k, v = qkv.view(b, s, heads, 3, d).unbind(3)
        x = x + lin(attention(q, k, v, self_mask), p + "self_attention.linear_proj")
        if context is not None:
            q = lin(ln(x, p + "pre_cross_attn_layernorm"), p + "cross_attention.linear_q")
            kv = lin(context, p + "cross_attention.linear_kv")
            k, v = kv.view(b, context.shape[1], heads, 2, d).unbind(3)
            q = q.view(b, s, heads, d)
            x = x + lin(attention(q, k, v, context_mask), p + "cross_attention.linear_proj")
        y = lin(ln(x, p + "pre_mlp_layernorm"), p + "mlp.linear_fc1")
        return x + lin(torch.nn.functional.gelu(y), p + "mlp.linear_fc2")

    key_masked = (padding == 0)[:, None, :]  # [b, 1, s_enc]
    x = embed(enc)
    for i in range(len(model.encoder.layers)):
        x = layer(x, f"encoder.layers.{i}.", key_masked)
    context = ln(x, "encoder.final_layernorm")
    s_dec = dec.shape[1]
    causal = torch.ones(s_dec, s_dec, dtype=torch.bool).triu(1)[None]
    x = embed(dec)
    for i in range(len(model.decoder.layers)):
        x = layer(x, f"decoder.layers.{i}.", causal, context, key_masked)
    x = ln(x, "decoder.final_layernorm")
    return x @ sd["embedding.word_embeddings.weight"].T + sd["lm_head.output_layer.bias"]


def test_t5_logits_match_a_float64_reference():
    config = _t5_config(init_method_std=0.1)
    model = T5Model(
        config,
        dataclasses.replace(config, num_layers=3),
        get_t5_encoder_layer_local_spec(),
        get_t5_decoder_layer_local_spec(),
        64,
        16,
        share_embeddings_and_output_weights=True,
    ).eval()
    with torch.no_grad():  # non-trivial biases and norms
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(2)
    enc = torch.randint(0, 64, (2, 12), generator=g)
    dec = torch.randint(0, 64, (2, 7), generator=g)
    padding = torch.ones_like(enc)
    padding[1, 8:] = 0
    with torch.no_grad():
        logits = model(enc, dec, padding)
    expected = _reference_t5_logits(model, enc, dec, padding, heads=4)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(logits.double(), expected, rtol=0, atol=1e-4)


def test_t5_encoder_and_decoder_layers_draw_dropout_from_the_rng_tracker(
    single_process_env, fresh_globals
):
    """Under tensor parallelism, dropout on head-split activations forks the tracker's
    model-parallel stream (``transformer.utils.model_parallel_rng``), so that each TP rank draws
    its own mask. T5 copies its config for the encoder (and the decoder): each copy must carry
    the run's tracker, or those layers would draw the same mask on every TP rank."""
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.training import global_vars
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model_families import get_model_family
    from tests.harness.argv import megatron_argv

    argv = megatron_argv(
        "--vocab-extra-ids", "100",
        num_layers=None, seq_length=None, mock_data=None, vocab_size=None,
        tokenizer_type="BertWordPieceLowerCase", vocab_file=VOCAB,
        encoder_num_layers="1", decoder_num_layers="1", hidden_size="32",
        num_attention_heads="4", encoder_seq_length="16", decoder_seq_length="8",
        max_position_embeddings="16", micro_batch_size="2", num_workers="0",
    )  # fmt: skip
    spec = get_model_family("t5")
    initialize_megatron(argv=argv, args_defaults=dict(spec.args_defaults))
    tracker = global_vars.get_rng_tracker()
    assert tracker is not None
    model = spec.model_provider()
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    assert len(blocks) == 2, blocks  # the encoder's and the decoder's
    for block in blocks:
        assert block.config.rng_tracker is tracker
        for layer in block.layers:
            assert layer.config.rng_tracker is tracker
