"""Multi-token prediction in checkpoints (issue #30): both formats hold the MTP layers under
Megatron's names (``mtp.layers.<k>.{enorm,hnorm,eh_proj,transformer_layer,final_layernorm}``),
and a run resumed from iteration 3 continues with the losses (lm and MTP) of the straight run.
A torch_dist checkpoint saved at PP=2 (the last stage holds the MTP layers and its copy of the
word embedding) resumes in one process."""

import json
import os

import torch

from tests.functional_tests.test_log_line_parity import _train
from tests.functional_tests.test_mtp_e2e import GPT
from tests.unit_tests.dist_utils import run_distributed

ITERATIONS = 6
MODEL = GPT + ["--train-iters", str(ITERATIONS), "--untie-embeddings-and-output-weights"]
MTP_NAMES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight")


def _losses(received, first):
    return {r["iteration"]: r["losses"] for r in received if r["iteration"] >= first}


def _assert_same(got, want, rtol):
    assert sorted(got) == sorted(want), (got, want)
    for it, losses in want.items():
        assert set(got[it]) == set(losses) and "mtp_2 loss" in losses, (it, got[it])
        for key, value in losses.items():
            assert abs(got[it][key] - value) <= rtol * abs(value), (it, key, got, want)


def _saved_keys(ckpt, fmt):
    path = os.path.join(ckpt, "iter_0000003")
    if fmt == "torch":
        state = torch.load(
            os.path.join(path, "mp_rank_00", "model_optim_rng.pt"), weights_only=False
        )
        return set(state["model"])
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def test_both_formats_save_mtp_and_resume(tmp_path):
    for fmt in ("torch", "torch_dist"):
        ckpt = str(tmp_path / fmt)
        save = ["--save", ckpt, "--save-interval", "3", "--ckpt-format", fmt]
        straight, _ = _train(MODEL + save)
        keys = _saved_keys(ckpt, fmt)
        for k in range(2):
            for name in MTP_NAMES:
                assert f"mtp.layers.{k}.{name}" in keys, (fmt, sorted(keys))
        # Within the transformer layer: the module names (torch), Megatron's fused names with
        # the linear layers' extra state (torch_dist), as for the decoder's layers.
        inner = "mtp.layers.1.transformer_layer."
        if fmt == "torch":
            expected = [inner + "input_layernorm.weight", "mtp.layers.1.eh_proj._extra_state"]
        else:
            expected = [
                inner + "self_attention.linear_qkv.layer_norm_weight",
                inner + "mlp.linear_fc1.layer_norm_weight",
                inner + "mlp.linear_fc2._extra_state/shard_0_1",
                "mtp.layers.1.eh_proj._extra_state/shard_0_1",
            ]
        assert set(expected) <= keys, (fmt, sorted(k for k in keys if k.startswith("mtp")))
        resumed, _ = _train(MODEL + ["--load", ckpt, "--ckpt-step", "3", "--ckpt-format", fmt])
        # The same layout and data: the continuation is the straight run's, bit for bit.
        _assert_same(_losses(resumed, 4), _losses(straight, 4), 0.0)


def _save_at_pp2(rank, world_size, ckpt, path):
    args = MODEL + ["--pipeline-model-parallel-size", "2", "--save", ckpt, "--save-interval", "3"]
    received, _ = _train(args + ["--ckpt-format", "torch_dist"])
    if rank == world_size - 1:
        with open(path, "w") as f:
            json.dump(received, f)


def test_torch_dist_saved_at_pp2_resumes_in_one_process(tmp_path):
    ckpt, path = str(tmp_path / "ckpt"), str(tmp_path / "pp2.json")
    run_distributed(_save_at_pp2, 2, ckpt, path)
    with open(path) as f:
        straight = json.load(f)
    resumed, _ = _train(MODEL + ["--load", ckpt, "--ckpt-step", "3", "--ckpt-format", "torch_dist"])
    # Another layout sums in another order: float round-off only.
    _assert_same(_losses(resumed, 4), _losses(straight, 4), 1e-5)
