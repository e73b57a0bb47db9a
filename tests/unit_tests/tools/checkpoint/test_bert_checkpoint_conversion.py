"""tools/checkpoint/convert.py --model-type BERT: a torch-format BERT checkpoint resharded to
TP=2 x PP=2 and back is bit-identical; exported to transformers' MegatronBertForPreTraining it
gives the model's logits within 1e-4, and imported back it is bit-identical again."""

import sys

import pytest
import torch

from megatron.checkpointing.torch_format import TorchCheckpointReader, TorchCheckpointWriter
from megatron.core.dist_checkpointing.megatron_layout import with_extra_state, without_extra_state
from megatron.core.models.bert import BertModel
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.functional_tests.runner import REPO
from tests.unit_tests.tiny_configs import tiny_args

sys.path.insert(0, str(REPO / "tools" / "checkpoint"))
import convert  # noqa: E402
import transformers  # noqa: E402  (a dependency of the package)

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 4, 64, 4, 32, 256


def _model_and_checkpoint(tmp_path, *flags):
    args = tiny_args(
        *flags,
        "--num-layers", LAYERS, "--hidden-size", HIDDEN, "--num-attention-heads", HEADS,
        "--seq-length", SEQ, "--max-position-embeddings", SEQ,
        drop=("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
              "--max-position-embeddings"),
    )  # fmt: skip
    args.padded_vocab_size = VOCAB
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_seed=11,
        init_method_std=0.1,
    )
    model = BertModel(
        config,
        num_tokentypes=2,
        transformer_layer_spec=bert_layer_local_spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=True,
    ).eval()
    writer = TorchCheckpointWriter(str(tmp_path / "src"), args, 7, False, torch.float32, False)
    for name, tensor in model.state_dict().items():
        writer.add(name, tensor)
    writer.write()
    return model


def test_reshard_round_trip_and_hf_export(tmp_path):
    model = _model_and_checkpoint(tmp_path, "--no-bias-gelu-fusion")  # the exact GeLU
    src, mid, back, hf = (str(tmp_path / n) for n in ("src", "tp2pp2", "back", "hf"))
    common = ["--model-type", "BERT", "--loader", "core"]
    convert.convert(
        common + ["--saver", "core", "--load-dir", src, "--save-dir", mid]
        + ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]
    )  # fmt: skip
    resharded = TorchCheckpointReader(mid)
    assert (resharded.tp, resharded.pp) == (2, 2)
    first = resharded.files[(1, 0, 0)]["model"]
    last = resharded.files[(1, 1, 0)]["model"]
    assert first["embedding.word_embeddings.weight"].shape == (VOCAB // 2, HIDDEN)
    assert "embedding.tokentype_embeddings.weight" in first and "pooler.dense.weight" not in first
    assert sorted(k for k in first if k.startswith("encoder.layers.") and "qkv.weight" in k) == [
        "encoder.layers.0.self_attention.linear_qkv.weight",
        "encoder.layers.1.self_attention.linear_qkv.weight",
    ]
    assert last["output_layer.bias"].shape == (VOCAB // 2,)
    assert {"lm_head.dense.weight", "binary_head.weight", "encoder.final_layernorm.weight"} <= set(
        last
    )

    convert.convert(common + ["--saver", "core", "--load-dir", mid, "--save-dir", back])
    restored = TorchCheckpointReader(back).files[(0, 0, 0)]["model"]
    original = model.state_dict()
    # megatron-core's (empty) _extra_state entries, as the trainer writes them for this model.
    assert restored.keys() - original.keys() == with_extra_state(model, original).keys() - original
    restored = without_extra_state(restored)
    assert sorted(restored) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(restored[name], tensor), name

    convert.convert(common + ["--saver", "hf_megatron_bert", "--load-dir", mid, "--save-dir", hf])
    peer = transformers.MegatronBertForPreTraining.from_pretrained(hf).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    types = (torch.arange(SEQ) >= SEQ // 2).long().expand(2, SEQ)
    padding = torch.ones_like(ids)
    padding[1, 20:] = 0
    with torch.no_grad():
        logits, binary = model(ids, padding, tokentype_ids=types)
        out = peer(input_ids=ids, attention_mask=padding, token_type_ids=types)
    real = padding.bool()
    torch.testing.assert_close(logits[real], out.prediction_logits[real], rtol=0, atol=1e-4)
    torch.testing.assert_close(binary, out.seq_relationship_logits, rtol=0, atol=1e-4)

    imported = str(tmp_path / "imported")
    convert.convert(
        ["--model-type", "BERT", "--loader", "hf_megatron_bert", "--saver", "core"]
        + ["--load-dir", hf, "--save-dir", imported]
    )
    restored = without_extra_state(TorchCheckpointReader(imported).files[(0, 0, 0)]["model"])
    assert sorted(restored) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(restored[name], tensor), name


def test_bert_conversion_refuses_what_it_cannot_do(tmp_path):
    _model_and_checkpoint(tmp_path)
    dirs = ["--load-dir", str(tmp_path / "src"), "--save-dir", str(tmp_path / "out")]
    with pytest.raises(convert.ConversionError, match="--model-type BERT converts with --loader"):
        convert.convert(["--model-type", "BERT", "--loader", "hf_llama", "--saver", "core"] + dirs)
    # Trained with the default fused (tanh) GeLU: Hugging Face cannot hold it with the exact
    # GeLU of the LM head.
    with pytest.raises(convert.ConversionError, match="train with --no-bias-gelu-fusion"):
        convert.convert(["--model-type", "BERT", "--saver", "hf_megatron_bert"] + dirs)
    assert not (tmp_path / "out").exists()
