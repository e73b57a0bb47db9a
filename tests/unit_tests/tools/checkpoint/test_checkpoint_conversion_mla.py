"""tools/checkpoint/convert.py with a multi-latent attention checkpoint: resharded from one file
to TP=2 x PP=2 and back it is bit-identical; the TP=2 files hold the MLA projections' shards as
the trainer splits them (column-parallel, also the down projections), the saved args and the
printed flags carry the MLA flags; the Hugging Face Llama saver refuses it in one line."""

import sys

import pytest
import torch

from megatron.checkpointing.errors import ConversionError
from megatron.checkpointing.torch_format import TorchCheckpointReader, TorchCheckpointWriter
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training.configs import core_transformer_config_from_args
from tests.functional_tests.runner import REPO
from tests.unit_tests.tiny_configs import tiny_args

sys.path.insert(0, str(REPO / "tools" / "checkpoint"))
import convert  # noqa: E402

MLA = (
    "--multi-latent-attention", "--q-lora-rank", 16, "--kv-lora-rank", 24, "--qk-head-dim", 8,
    "--qk-pos-emb-head-dim", 8, "--v-head-dim", 12, "--qk-layernorm", "--normalization",
    "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--rotary-scaling-factor", 4,
    "--mscale", 0.7, "--mscale-all-dim", 0.7, "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--num-layers", 4, "--hidden-size", 64,
    "--num-attention-heads", 4, "--seq-length", 32, "--max-position-embeddings", 32,
)  # fmt: skip


def test_mla_reshard_round_trip_and_refusals(tmp_path, capsys):
    args = tiny_args(
        *MLA,
        drop=("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
              "--max-position-embeddings"),
    )  # fmt: skip
    args.padded_vocab_size = 256
    config = core_transformer_config_from_args(args)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(multi_latent_attention=True),
        vocab_size=256,
        max_sequence_length=32,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    src, mid, back = (str(tmp_path / n) for n in ("src", "tp2pp2", "back"))
    writer = TorchCheckpointWriter(src, args, 7, False, torch.float32, True)
    for name, tensor in model.state_dict().items():
        writer.add(name, tensor)
    writer.write()
    common = ["--model-type", "GPT", "--loader", "core", "--saver", "core"]
    convert.convert(
        common + ["--load-dir", src, "--save-dir", mid]
        + ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"],
        in_process=True,
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 24" in printed
    assert "--qk-layernorm" in printed
    resharded = TorchCheckpointReader(mid)
    assert (resharded.tp, resharded.pp) == (2, 2)
    saved = resharded.args
    assert (saved.multi_latent_attention, saved.kv_lora_rank, saved.v_head_dim) == (True, 24, 12)
    full = model.state_dict()
    layer = "decoder.layers.0.self_attention."
    for t in (0, 1):
        shard = resharded.files[(t, 0, 0)]["model"]
        for name in ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj"):
            rows = full[layer + name + ".weight"].chunk(2)[t]
            assert torch.equal(shard[layer + name + ".weight"], rows), name
        assert torch.equal(
            shard[layer + "kv_layernorm.weight"], full[layer + "kv_layernorm.weight"]
        )
        proj = full[layer + "linear_proj.weight"].chunk(2, dim=1)[t]
        assert torch.equal(shard[layer + "linear_proj.weight"], proj)
    convert.convert(
        common + ["--load-dir", mid, "--save-dir", back]
        + ["--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"],
        in_process=True,
    )  # fmt: skip
    again = TorchCheckpointReader(back)
    for name, tensor in full.items():
        assert torch.equal(again.tensor(name), tensor), name
    with pytest.raises(ConversionError, match="multi-latent attention"):
        convert.convert(
            ["--model-type", "GPT", "--loader", "core", "--saver", "hf_llama"]
            + ["--load-dir", src, "--save-dir", str(tmp_path / "hf")],
            in_process=True,
        )
