"""Megatron -> Megatron resharding of torch-format checkpoints through convert.py (core
loader/saver)."""

import argparse
import os
import subprocess
import sys

import pytest
import torch
import transformers  # a dependency (setup.py): missing, it must fail, not skip

from megatron.core.dist_checkpointing.megatron_layout import (  # noqa: E402
    with_extra_state,
    without_extra_state,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.pipeline_parallel.layer_split import compute_layer_split  # noqa: E402
from megatron.training.configs import core_transformer_config_from_args  # noqa: E402
from tests.harness import REPO

_TOOLS = str(REPO / "tools" / "checkpoint")
sys.path.insert(0, _TOOLS)
import convert  # noqa: E402
from protocol import ConversionError  # noqa: E402


def run(*argv):
    convert.convert(["--model-type", "GPT", *[str(a) for a in argv]], in_process=True)


def load(path):
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, weights_only=True)


def shard(ckpt, tp, pp, pp_size, sub="release"):
    name = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pp_size > 1 else "")
    return load(os.path.join(ckpt, sub, name, "model_optim_rng.pt"))


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory):
    """A SwiGLU + GQA + qkv-bias model (the hardest TP layouts) saved at TP=2, PP=2."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    hf = tmp_path_factory.mktemp("hf")
    transformers.Qwen2ForCausalLM(config).save_pretrained(hf)
    ckpt = tmp_path_factory.mktemp("tp2pp2")
    run(
        "--loader",
        "hf_llama",
        "--saver",
        "core",
        "--load-dir",
        hf,
        "--save-dir",
        ckpt,
        "--target-tensor-parallel-size",
        2,
        "--target-pipeline-parallel-size",
        2,
    )
    return ckpt


def gather_by_hand(ckpt):
    """Independent gather of a TP=2, PP=2 SwiGLU checkpoint into TP=1, PP=1 names."""
    full = {}
    for pp in range(2):
        shards = [shard(ckpt, tp, pp, 2)["model"] for tp in range(2)]
        for name in shards[0]:
            if name.endswith("._extra_state"):  # megatron-core's empty entries, checked apart
                continue
            a, b = shards[0][name], shards[1][name]
            if name.startswith("decoder.layers."):
                _, _, i, rest = name.split(".", 3)
                name = f"decoder.layers.{int(i) + 2 * pp}.{rest}"
            if "linear_fc1" in name:  # each shard is [gate_shard; up_shard]
                ga, ua = a.chunk(2)
                gb, ub = b.chunk(2)
                value = torch.cat([ga, gb, ua, ub])
            elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                value = torch.cat([a, b], dim=1)
            elif name.endswith(
                (
                    "linear_qkv.weight",
                    "linear_qkv.bias",
                    "word_embeddings.weight",
                    "output_layer.weight",
                )
            ):
                value = torch.cat([a, b], dim=0)
            else:
                assert torch.equal(a, b), name
                value = a
            full[name] = value
    return full


def test_tp2_pp2_to_tp1_pp1_equals_gathered_originals(tp2pp2, tmp_path):
    run(
        "--loader",
        "core",
        "--saver",
        "core",
        "--load-dir",
        tp2pp2,
        "--save-dir",
        tmp_path / "tp1",
        "--target-tensor-parallel-size",
        1,
        "--target-pipeline-parallel-size",
        1,
    )
    assert not (tmp_path / "tp1" / "release" / "mp_rank_00_000").exists()
    state = shard(tmp_path / "tp1", 0, 0, 1)
    expected = gather_by_hand(tp2pp2)
    # Padding at TP=1 is 128 rows instead of 256 at TP=2: compare the real rows and the shapes.
    extra = {k: v for k, v in state["model"].items() if k.endswith("._extra_state")}
    got = {k: v for k, v in state["model"].items() if k not in extra}
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert got[name].shape == (128, 32)
            assert torch.equal(got[name][:100], value[:100]), name
        else:
            assert torch.equal(got[name], value), name
    args = state["args"]
    assert args.tensor_model_parallel_size == 1 and args.pipeline_model_parallel_size == 1
    assert args.padded_vocab_size == 128
    # The keys and shapes are exactly what our model builds from the saved args.
    model = GPTModel(
        core_transformer_config_from_args(args),
        get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    model.load_state_dict(got, strict=True)
    # megatron-core's state_dict() has an empty _extra_state per linear module (Megatron-LM
    # loads the file strictly): the same entries as the trainer writes for this model.
    written = with_extra_state(model, model.state_dict())
    assert extra == {k: v for k, v in written.items() if not torch.is_tensor(v)}
    assert set(extra.values()) == {None} and len(extra) == 4 * 4 + 1


def test_virtual_stages_and_back_is_identical(tp2pp2, tmp_path):
    """TP=2·PP=2 -> TP=1·PP=2 with 2 virtual stages per rank -> TP=2·PP=2 again: bit-identical."""
    run(
        "--loader",
        "core",
        "--saver",
        "core",
        "--load-dir",
        tp2pp2,
        "--save-dir",
        tmp_path / "vpp",
        "--target-tensor-parallel-size",
        1,
        "--target-pipeline-parallel-size",
        2,
        "--target-num-virtual-stages-per-pipeline-rank",
        2,
    )
    args = shard(tmp_path / "vpp", 0, 0, 2)["args"]
    split = compute_layer_split(4, 2, 2)
    config = core_transformer_config_from_args(args)
    for pp in range(2):
        state = shard(tmp_path / "vpp", 0, pp, 2)
        assert "model" not in state and sorted(k for k in state if k.startswith("model")) == [
            "model0",
            "model1",
        ]
        for chunk in range(2):
            kw = split.chunk_args(pp, chunk)
            stage = GPTModel(
                config,
                get_gpt_layer_local_spec(),
                vocab_size=args.padded_vocab_size,
                max_sequence_length=64,
                position_embedding_type="rope",
                share_embeddings_and_output_weights=False,
                **kw,
            )
            saved = state[f"model{chunk}"]
            stage.load_state_dict(without_extra_state(saved), strict=True)
            # Each virtual stage's _extra_state entries (the output layer's on the last only).
            expected_extra = with_extra_state(stage, stage.state_dict()).keys() - stage.state_dict()
            assert saved.keys() - stage.state_dict().keys() == expected_extra
    run(
        "--loader",
        "core",
        "--saver",
        "core",
        "--load-dir",
        tmp_path / "vpp",
        "--save-dir",
        tmp_path / "again",
        "--target-tensor-parallel-size",
        2,
        "--target-pipeline-parallel-size",
        2,
    )
    for tp in range(2):
        for pp in range(2):
            a, b = shard(tp2pp2, tp, pp, 2)["model"], shard(tmp_path / "again", tp, pp, 2)["model"]
            assert sorted(a) == sorted(b)
            for name in a:
                if name.endswith("._extra_state"):
                    assert a[name] is None and b[name] is None, name
                else:
                    assert torch.equal(a[name], b[name]), (tp, pp, name)


def test_incomplete_checkpoint_is_refused(tp2pp2, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tp2pp2, broken)
    shutil.rmtree(broken / "release" / "mp_rank_01_001")
    with pytest.raises(ConversionError, match="incomplete"):
        run(
            "--loader",
            "core",
            "--saver",
            "core",
            "--load-dir",
            broken,
            "--save-dir",
            tmp_path / "x",
        )
    (broken / "latest_checkpointed_iteration.txt").write_text("banana")
    with pytest.raises(ConversionError, match="expected an iteration number"):
        run(
            "--loader",
            "core",
            "--saver",
            "core",
            "--load-dir",
            broken,
            "--save-dir",
            tmp_path / "x",
        )


def test_command_line_runs_the_saver_in_a_child_process(tp2pp2, tmp_path):
    script = os.path.join(_TOOLS, "convert.py")
    done = subprocess.run(
        [
            sys.executable,
            script,
            "--model-type",
            "GPT",
            "--loader",
            "core",
            "--saver",
            "core",
            "--load-dir",
            str(tp2pp2),
            "--save-dir",
            str(tmp_path / "cli"),
            "--target-tensor-parallel-size",
            "1",
            "--target-pipeline-parallel-size",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2" in done.stdout
    assert (tmp_path / "cli" / "release" / "mp_rank_00_001" / "model_optim_rng.pt").is_file()
    assert (
        convert.main(
            [
                "--model-type",
                "GPT",
                "--loader",
                "core",
                "--saver",
                "nope",
                "--load-dir",
                str(tp2pp2),
                "--save-dir",
                str(tmp_path / "x"),
            ]
        )
        == 1
    )


def test_a_megatron_lm_file_with_numpy_rng_state_is_read(tp2pp2, tmp_path):
    """Megatron-LM's torch-format files hold numpy's RNG state as a numpy array (its
    ``rng_state[i]["np_rng_state"]`` is ``np.random.get_state()``): the loader reads them, under
    ``weights_only=True``, and converts the same weights as without it."""
    import shutil

    import numpy as np

    megatron_lm = tmp_path / "megatron_lm"
    shutil.copytree(tp2pp2, megatron_lm)
    for tp in range(2):
        for pp in range(2):
            path = megatron_lm / "release" / f"mp_rank_{tp:02d}_{pp:03d}" / "model_optim_rng.pt"
            state = load(path)
            state["rng_state"] = [
                {"random_rng_state": (3, (0,) * 625, None), "np_rng_state": np.random.get_state()}
            ]
            torch.save(state, path)
    for source, target in ((tp2pp2, "plain"), (megatron_lm, "numpy")):
        run("--loader", "core", "--saver", "core", "--load-dir", source,
            "--save-dir", tmp_path / target, "--target-tensor-parallel-size", 1,
            "--target-pipeline-parallel-size", 1)  # fmt: skip
    plain, numpy_rng = shard(tmp_path / "plain", 0, 0, 1), shard(tmp_path / "numpy", 0, 0, 1)
    assert sorted(plain["model"]) == sorted(numpy_rng["model"])
    for name, value in plain["model"].items():
        if torch.is_tensor(value):
            assert torch.equal(numpy_rng["model"][name], value), name
