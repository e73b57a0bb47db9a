"""torch_dist checkpoints exchanged with the real megatron-core (0.16.1, from PyPI), both ways.

megatron-core runs in its own environment (its import name ``megatron`` is ours too), driven by
``tools/interop/mcore_gpt.py`` through ``$MCORE_PYTHON``; ``make interop`` builds that
environment and runs this file (``make test`` does not collect it: see pyproject.toml).

* megatron-core writes a 4-layer GPT (local spec, fp32); this code base loads it at TP=2 and at
  PP=2 and must give the loss megatron-core gave on the same batch (1e-5 relative);
  ``pretrain_gpt.py --load`` says in one line that it holds no optimizer state, and resumes
  from it with ``--no-load-optim``.
* ``pretrain_gpt.py`` trains 3 iterations at TP=2 x PP=2 with the distributed optimizer and
  saves; megatron-core loads that checkpoint: every tensor it loaded equals the checkpoint's
  (read here, whole, by name), no model tensor is left out, and its loss on the batch equals the
  loss of this code base's model loaded from the same checkpoint.
* The ``torch`` format (``mp_rank_00/model_optim_rng.pt``), model part: megatron-core's file
  resumes ``pretrain_gpt.py --ckpt-format torch``; ours loads strictly into megatron-core's model
  and gives the loss ours gives.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.megatron_layout import (
    unstack,
    with_extra_state,
    without_extra_state,
)
from tests.functional_tests.runner import TINY_MODEL, run_pretrain
from tests.harness import REPO
from tests.harness.argv import TINY_RUN, megatron_argv
from tests.unit_tests.dist_utils import run_distributed

DRIVER = REPO / "tools" / "interop" / "mcore_gpt.py"
MCORE_PYTHON = os.environ.get("MCORE_PYTHON")
RTOL = 1e-5


# The model both sides build: megatron-core's defaults for the rest (LayerNorm, GeLU, biases,
# learned absolute positions, untied output layer).
LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 4, 32, 4, 64, 16


def _mcore(action, directory, out, *extra):
    command = [MCORE_PYTHON, str(DRIVER), action, str(directory), "--out", str(out)]
    command += [str(e) for e in extra]
    # Without our PYTHONPATH: there, `megatron` would be this code base.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(Path(out).read_text())


def _batch(vocab, seq):
    # The batch of tools/interop/mcore_gpt.py (the same generator calls).
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (2, seq), generator=g)
    labels = torch.randint(0, vocab, (2, seq), generator=g)
    return tokens, torch.arange(seq).unsqueeze(0).expand_as(tokens), labels


def _our_model(state, pre=True, post=True, num_layers=None, offset=None, **overrides):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=state.get_pipeline_model_parallel_world_size(),
    )
    vocab = overrides.pop("vocab_size", VOCAB)
    seq = overrides.pop("max_sequence_length", SEQ)
    tied = overrides.pop("share_embeddings_and_output_weights", False)
    settings.update(overrides)
    torch.manual_seed(99)  # not the checkpoint's weights: the load must replace every one
    config = TransformerConfig(**settings)
    return GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=tied,
        num_layers=num_layers,
        layer_number_offset=offset,
        pg_collection=state,
    )


def _load(model, state, directory):
    entries, _ = dc.model_sharded_state_dict(
        [model],
        state.get_tensor_model_parallel_rank(),
        state.get_tensor_model_parallel_world_size(),
    )
    # Every model tensor of the checkpoint must be asked for (the _extra_state objects are not
    # tensors); every tensor asked for must be there.
    dc.load_shards(
        entries,
        str(directory),
        strictness=dc.StrictHandling.RAISE_ALL,
        counts_as_unexpected=lambda key: not key.startswith("optimizer."),
    )
    model.eval()


def _worker_loads_mcore_checkpoint(rank, world, directory, expected):
    from megatron.core.parallel_state import initialize_model_parallel

    tokens, positions, labels = _batch(VOCAB, SEQ)
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    model = _our_model(state)
    _load(model, state, directory)
    with torch.no_grad():
        loss = model(tokens, positions, None, labels=labels).mean().item()
    assert abs(loss - expected) <= RTOL * abs(expected), ("TP=2", loss, expected)

    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    first = state.is_pipeline_first_stage()
    half = LAYERS // 2
    model = _our_model(state, pre=first, post=not first, num_layers=half, offset=rank * half)
    _load(model, state, directory)
    with torch.no_grad():
        if first:
            hidden = model(tokens, positions, None)
            torch.distributed.send(hidden.contiguous(), dst=1)
        else:
            hidden = torch.empty(SEQ, 2, HIDDEN)
            torch.distributed.recv(hidden, src=0)
            model.set_input_tensor(hidden)
            loss = model(None, positions, None, labels=labels).mean().item()
            assert abs(loss - expected) <= RTOL * abs(expected), ("PP=2", loss, expected)


def test_megatron_core_checkpoint_loads_here_at_tp2_and_pp2(tmp_path):
    saved = tmp_path / "mcore"
    in_torch_format = tmp_path / "mcore_torch"
    result = _mcore(
        "save",
        saved,
        tmp_path / "saved.json",
        "--num-layers",
        LAYERS,
        "--torch-save",
        in_torch_format,
    )
    written = saved / "iter_0000001"
    names = set(dc.tensor_shapes(dc.read_dcp_metadata(str(written))))
    assert "decoder.layers.self_attention.linear_qkv.weight" in names  # the layout we map
    run_distributed(_worker_loads_mcore_checkpoint, 2, str(written), result["loss"])

    # Through pretrain_gpt.py: the checkpoint holds no optimizer state, which one clear line
    # says; with --no-load-optim the model loads and training goes on from its iteration.
    flags = megatron_argv(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        seq_length=SEQ,
        max_position_embeddings=SEQ,
        vocab_size=VOCAB - 1,
        make_vocab_size_divisible_by=1,
        untie_embeddings_and_output_weights=True,
        micro_batch_size=2,
        train_iters=2,
        lr=1e-3,
        log_interval=1,
        load=saved,
    )
    refused = run_pretrain(flags)
    assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr, refused.stderr[-3000:]
    line = [x for x in refused.stderr.splitlines() if x.startswith("error:")][-1]
    assert "holds no optimizer state" in line and "--no-load-optim or --finetune" in line, line
    resumed = run_pretrain(flags + ["--no-load-optim"])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"successfully loaded checkpoint from {saved}" in resumed.stdout
    # Resumed after iteration 1: iteration 2 is the only one trained.
    assert "iteration        2/       2" in resumed.stdout
    assert "iteration        1/       2" not in resumed.stdout
    # The same model in Megatron-LM's torch format (mp_rank_00/model_optim_rng.pt).
    flags[flags.index("--load") + 1] = str(in_torch_format)
    resumed = run_pretrain(flags + ["--no-load-optim", "--ckpt-format", "torch"])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"successfully loaded checkpoint from {in_torch_format}" in resumed.stdout
    assert "iteration        2/       2" in resumed.stdout


# ------------------------------------------------------------------ written here, read there
def _flag(name):
    return TINY_MODEL[TINY_MODEL.index(name) + 1]


def _checkpoint_tensors(directory):
    """The model tensors of a torch_dist directory, whole, under per-layer names."""
    shapes = dc.tensor_shapes(dc.read_dcp_metadata(str(directory)))
    entries = {
        k: dc.replicated(k, torch.empty(shape, dtype=dtype))
        for k, (shape, dtype) in shapes.items()
        if not k.startswith("optimizer.")
    }
    dc.load_shards(entries, str(directory))
    return unstack({k: e.data for k, e in entries.items()})


def test_checkpoint_written_here_at_tp2_pp2_distopt_loads_in_megatron_core(tmp_path):
    from megatron.core.parallel_state import initialize_model_parallel

    save = tmp_path / "ours"
    args = megatron_argv(base=TINY_RUN, num_layers=LAYERS, ckpt_format=None)  # torch_dist
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    result = run_pretrain(
        args
        + layout
        + ["--use-distributed-optimizer", "--train-iters", "3", "--save", str(save)]
        + ["--save-interval", "3", "--hidden-dropout", "0.0", "--attention-dropout", "0.0"],
        nproc=4,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    directory = save / "iter_0000003"
    tensors = _checkpoint_tensors(directory)
    vocab, hidden = tensors["embedding.word_embeddings.weight"].shape  # padded vocabulary
    seq = int(_flag("--seq-length"))
    model_flags = ["--num-layers", str(LAYERS), "--hidden-size", str(hidden), "--tied"]
    model_flags += ["--num-attention-heads", _flag("--num-attention-heads")]
    model_flags += ["--vocab-size", str(vocab), "--seq-length", str(seq)]
    model_flags += ["--max-position-embeddings", _flag("--max-position-embeddings")]
    # The same model in the torch format, at TP=1 x PP=1 (one file), for megatron-core to load
    # strictly as Megatron-LM does.
    torch_save = tmp_path / "ours_torch"
    result = run_pretrain(
        args
        + ["--ckpt-format", "torch", "--train-iters", "3", "--save", str(torch_save)]
        + ["--save-interval", "3", "--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    torch_file = torch_save / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    loaded = _mcore(
        "load",
        directory,
        tmp_path / "mc.json",
        "--tensors",
        tmp_path / "mc.pt",
        "--torch-load",
        torch_file,
        *model_flags,
    )
    theirs = torch.load(tmp_path / "mc.pt", weights_only=True)
    assert sorted(theirs) == sorted(tensors)  # no model tensor left out, none extra
    for name, tensor in theirs.items():
        assert torch.equal(tensor, tensors[name]), name

    state = initialize_model_parallel()  # one process, no torch.distributed
    model = _our_model(
        state,
        hidden_size=hidden,
        num_attention_heads=int(_flag("--num-attention-heads")),
        vocab_size=vocab,
        max_sequence_length=int(_flag("--max-position-embeddings")),
        share_embeddings_and_output_weights=True,
    )
    _load(model, state, directory)
    # The torch format's model entry: megatron-core's state_dict() has the same other entries
    # (_extra_state) as ours writes.
    ours_other = with_extra_state(model, model.state_dict())
    assert (
        sorted(k for k, v in ours_other.items() if not torch.is_tensor(v)) == loaded["other_keys"]
    )
    tokens, positions, labels = _batch(vocab, seq)
    with torch.no_grad():
        ours = model(tokens, positions, None, labels=labels).mean().item()
    assert abs(ours - loaded["loss"]) <= RTOL * abs(loaded["loss"]), (ours, loaded["loss"])

    with torch.serialization.safe_globals([argparse.Namespace]):
        saved = torch.load(torch_file, weights_only=True)["model"]
    model.load_state_dict(without_extra_state(saved), strict=True)
    with torch.no_grad():
        ours = model(tokens, positions, None, labels=labels).mean().item()
    expected = loaded["torch_loss"]
    assert abs(ours - expected) <= RTOL * abs(expected), ("torch format", ours, expected)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
