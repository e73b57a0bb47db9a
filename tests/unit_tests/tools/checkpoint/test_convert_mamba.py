"""``convert.py --model-type MAMBA``: a NemotronH Hugging Face directory (Mamba-2, attention, a
squared-ReLU MLP and MoE layers, ``M*EM-E``) <-> our ``pretrain_mamba.py`` checkpoints.

* HF -> ours at TP2 x PP2 -> HF returns every tensor bit for bit under the same names;
* ours TP2 x PP2 -> TP1 x PP1 -> HF likewise;
* our MambaModel built from the TP1 x PP1 checkpoint's saved args (the trainer's config path)
  gives transformers' logits within 1e-4 (float32). That the TP2 files hold exactly the trainer's
  TP2 shards (Mamba's in_proj/conv1d part by part) is test_tp_shards' proof;
* bad input (a loader of GPT models with --model-type MAMBA, a hybrid checkpoint as GPT, a
  NemotronH config with latent MoE) ends with one line naming the problem and exit status 1.
"""

import json

import pytest
import torch

from megatron.core.dist_checkpointing.megatron_layout import without_extra_state
from megatron.core.models.mamba import MambaModel
from megatron.training.configs import core_transformer_config_from_args
from tests.unit_tests.tools.checkpoint.test_checkpoint_conversion_hf import (
    ConversionError,
    assert_same_tensors,
    convert,
    load_shard,
)
from tests.unit_tests.tools.checkpoint.test_nemotron_h_conversion import VOCAB, hf_model


def run(*argv):
    convert.convert(["--model-type", "MAMBA", *[str(a) for a in argv]], in_process=True)


def test_nemotron_h_round_trips_through_tp2_pp2_and_tp1_pp1(tmp_path):
    model = hf_model()
    src, tp2, tp1 = tmp_path / "hf", tmp_path / "tp2pp2", tmp_path / "tp1pp1"
    model.save_pretrained(src)
    layout = ["--target-tensor-parallel-size", 2, "--target-pipeline-parallel-size", 2]
    run(
        "--loader",
        "hf_nemotron_h",
        "--saver",
        "core",
        "--load-dir",
        src,
        "--save-dir",
        tp2,
        *layout,
    )
    back = tmp_path / "back_from_tp2"
    run("--loader", "core", "--saver", "hf_nemotron_h", "--load-dir", tp2, "--save-dir", back)
    assert_same_tensors(src, back)

    one = ["--target-tensor-parallel-size", 1, "--target-pipeline-parallel-size", 1]
    run("--loader", "core", "--saver", "core", "--load-dir", tp2, "--save-dir", tp1, *one)
    back = tmp_path / "back_from_tp1"
    run("--loader", "core", "--saver", "hf_nemotron_h", "--load-dir", tp1, "--save-dir", back)
    assert_same_tensors(src, back)
    config = json.loads((back / "config.json").read_text())
    assert config["layers_block_type"] == model.config.layers_block_type
    assert config["n_group"] == 2 and config["routed_scaling_factor"] == 2.5

    # The trainer's model from the checkpoint's own args.
    state = load_shard(tp1)
    args = state["args"]
    assert (args.hybrid_override_pattern, args.squared_relu) == ("M*EM-E", True)
    assert (args.mamba_num_heads, args.num_experts, args.moe_router_score_function) == (
        8,
        4,
        "sigmoid",
    )
    ours = MambaModel(
        core_transformer_config_from_args(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        hybrid_override_pattern=args.hybrid_override_pattern,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    ).eval()
    ours.load_state_dict(without_extra_state(state["model"]), strict=True)
    tokens = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(tokens).logits
        got = ours(tokens, None, None)[..., :VOCAB]
    assert (got - want).abs().max().item() < 1e-4
    assert want.std() > 0.1


def test_bad_input_ends_with_one_line(tmp_path, capsys):
    tp1 = tmp_path / "tp1"
    src = tmp_path / "hf"
    hf_model().save_pretrained(src)
    run("--loader", "hf_nemotron_h", "--saver", "core", "--load-dir", src, "--save-dir", tp1)
    capsys.readouterr()
    out = tmp_path / "out"
    # convert.main: one line on stderr, status 1 (refused while parsing, before any process).
    code = convert.main(
        ["--model-type", "MAMBA", "--loader", "hf_llama", f"--load-dir={src}", f"--save-dir={out}"]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1
    assert err == ["error: --model-type MAMBA: the hf_llama loader converts GPT models only"]
    # The loaders' refusals: main prints each as its one line (in-process here, to save the
    # saver process's start).
    with pytest.raises(
        ConversionError, match=r"is a hybrid \(Mamba\) checkpoint .*use --model-type MAMBA"
    ):
        convert.convert(
            ["--model-type", "GPT", f"--load-dir={tp1}", f"--save-dir={out}"], in_process=True
        )
    config = json.loads((src / "config.json").read_text())
    config["moe_latent_size"] = 8
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="^config.json: moe_latent_size=8 is not supported"):
        run("--loader", "hf_nemotron_h", "--saver", "core", "--load-dir", src, "--save-dir", out)
    assert not out.exists()
