"""torch_dist checkpoints through tools/checkpoint/convert.py (core loader -> Hugging Face GPT-2).

Two short training runs with identical settings, one saving ``--ckpt-format torch`` and one
``torch_dist``, must convert to byte-identical Hugging Face weights; transformers' GPT-2 built
from them must give our model's logits (loaded from the torch-format shard) within 1e-4.
"""

import argparse
import os
import sys

import pytest
import torch
import transformers  # a dependency (setup.py): missing, it must fail, not skip
from safetensors.torch import load_file  # noqa: E402

from megatron.core.dist_checkpointing.megatron_layout import without_extra_state
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.training.configs import core_transformer_config_from_args  # noqa: E402
from tests.harness import REPO

_REPO = str(REPO)
sys.path.insert(0, os.path.join(_REPO, "tools", "checkpoint"))
sys.path.insert(0, _REPO)
import convert  # noqa: E402
from protocol import ConversionError  # noqa: E402

from tests.functional_tests.runner import run_pretrain  # noqa: E402
from tests.harness.argv import MOCK_DATA, megatron_argv  # noqa: E402

TRAIN = megatron_argv(
    base=MOCK_DATA,
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=32,
    max_position_embeddings=32,
    micro_batch_size=2,
    global_batch_size=4,
    lr="5e-3",
    vocab_size=500,
    num_workers=0,
    log_interval=1,
    eval_iters=0,
    seed=1234,
    train_iters=2,
    save_interval=2,
)


def _train(save_dir, fmt):
    result = run_pretrain(TRAIN + ["--ckpt-format", fmt, "--save", str(save_dir)], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]


def _to_hf(load_dir, save_dir):
    convert.convert(
        [
            "--model-type",
            "GPT",
            "--loader",
            "core",
            "--saver",
            "hf_gpt2",
            "--load-dir",
            str(load_dir),
            "--save-dir",
            str(save_dir),
        ],
        in_process=True,
    )
    return load_file(os.path.join(save_dir, "model.safetensors"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_conv")
    _train(root / "torch", "torch")
    _train(root / "dist", "torch_dist")
    assert os.path.isfile(root / "dist" / "iter_0000002" / "metadata.json")
    return root


def test_torch_dist_to_hf_matches_torch_format_and_logits(checkpoints, tmp_path):
    from_dist = _to_hf(checkpoints / "dist", tmp_path / "hf_dist")
    from_torch = _to_hf(checkpoints / "torch", tmp_path / "hf_torch")
    assert sorted(from_dist) == sorted(from_torch)
    for name in from_torch:
        assert torch.equal(from_dist[name], from_torch[name]), name

    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(
            checkpoints / "torch" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt",
            weights_only=True,
        )
    args = state["args"]
    model = GPTModel(
        core_transformer_config_from_args(args),
        get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
    # The file carries megatron-core's (empty) _extra_state entries; our modules keep none.
    model.load_state_dict(without_extra_state(state["model"]), strict=True)
    model.eval()
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf_dist")).eval()
    torch.manual_seed(1)
    tokens = torch.randint(0, 500, (2, 16))
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)
    with torch.no_grad():
        ours = model(tokens, positions, None)
        theirs = hf(input_ids=tokens).logits
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert theirs.abs().max() > 1e-2


def test_incomplete_torch_dist_is_a_clear_error(checkpoints, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoints / "dist", broken)
    os.remove(broken / "iter_0000002" / "common.pt")
    with pytest.raises(ConversionError, match="common.pt"):
        _to_hf(broken, tmp_path / "out")
