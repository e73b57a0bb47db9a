"""--ckpt-format fsdp_dtensor is Megatron-LM's own layout here (a bare DCP directory keyed
``model.module.*``; megatron/training/checkpointing_fsdp_dtensor.py): the format is detected from
the directory, and, as Megatron-LM (which converts with tools/checkpoint/checkpoint_inspector.py),
neither fsdp_dtensor nor torch_dist is read under the other's --ckpt-format: one line says so,
unless --auto-detect-ckpt-format (or a conversion) asks to read what is there. The flattening of
the non-tensor state is DCP's."""

import types
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.fsdp_dtensor import flatten, unflatten
from megatron.checkpointing.layout import detect_format, format_to_load


def _args(fmt, auto=False):
    return types.SimpleNamespace(
        ckpt_format=fmt, auto_detect_ckpt_format=auto, ckpt_convert_format=None
    )


def _bare_dcp(path, key):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({key: torch.zeros(2)}, checkpoint_id=str(path), no_dist=True)


def test_torch_dist_is_refused_by_fsdp_dtensor_in_one_line_unless_detecting(tmp_path):
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(
        CheckpointError,
        match="is a torch_dist-format checkpoint but --ckpt-format is fsdp_dtensor: pass "
        "--ckpt-format torch_dist or --auto-detect-ckpt-format, or convert it",
    ):
        format_to_load(_args("fsdp_dtensor"), str(tmp_path))
    assert format_to_load(_args("fsdp_dtensor", auto=True), str(tmp_path)) == "torch_dist"


def test_megatron_lm_fsdp_dtensor_directory_is_detected(tmp_path):
    _bare_dcp(tmp_path, "model.module.embedding.word_embeddings.weight")
    assert detect_format(str(tmp_path)) == "fsdp_dtensor"
    assert format_to_load(_args("fsdp_dtensor"), str(tmp_path)) == "fsdp_dtensor"
    with pytest.raises(
        CheckpointError, match="is a fsdp_dtensor-format checkpoint but --ckpt-format is torch_dist"
    ):
        format_to_load(_args("torch_dist"), str(tmp_path))


def test_bare_dcp_directory_without_model_keys_is_an_unfinished_save(tmp_path):
    _bare_dcp(tmp_path, "decoder.final_layernorm.weight")
    with pytest.raises(
        CheckpointError, match="has no metadata.json and no fsdp_dtensor model keys"
    ):
        format_to_load(_args("fsdp_dtensor"), str(tmp_path))


def test_flatten_is_dcp_and_unflatten_inverts_it():
    # torch.distributed.checkpoint's own flattening of the same dict gives the same keys.
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    state = {
        "opt_param_scheduler": {"max_lr": 5e-3, "num_steps": 24},
        "optimizer": {"param_groups": [{"lr": 1.0, "betas": (0.9, 0.99)}, {"lr": 2.0}]},
        "rng_state": {"(0, 1)": [{"torch_rng_state": torch.arange(3), "tracker": {"a": 1}}]},
        "iteration": 3,
    }
    flat = {}
    for name, value in state.items():
        flatten(name, value, flat)
    assert set(flat) == set(flatten_state_dict(state)[0])
    assert "rng_state.(0, 1).0.torch_rng_state" in flat
    for name, value in state.items():
        back = unflatten(
            {k: v for k, v in flat.items() if k == name or k.startswith(name + ".")}, name
        )
        if name == "rng_state":
            assert torch.equal(back["(0, 1)"][0]["torch_rng_state"], torch.arange(3))
            assert back["(0, 1)"][0]["tracker"] == {"a": 1}
        else:
            assert back == value
