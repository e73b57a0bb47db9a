"""--ckpt-format fsdp_dtensor (Megatron-FSDP) is written in the torch_dist layout here, so the
loader reads a torch_dist checkpoint under either flag, and a bare DCP directory (Megatron-LM's own
fsdp_dtensor layout) is named as not read here."""

import types

import pytest

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.layout import format_to_load


def _args(fmt):
    return types.SimpleNamespace(
        ckpt_format=fmt, auto_detect_ckpt_format=False, ckpt_convert_format=None
    )


def test_fsdp_dtensor_and_torch_dist_read_each_other(tmp_path):
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / ".metadata").write_bytes(b"")
    assert format_to_load(_args("fsdp_dtensor"), str(tmp_path)) == "torch_dist"
    assert format_to_load(_args("torch_dist"), str(tmp_path)) == "torch_dist"


def test_megatron_lm_fsdp_dtensor_directory_is_named(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="Megatron-LM's own fsdp_dtensor layout"):
        format_to_load(_args("fsdp_dtensor"), str(tmp_path))
