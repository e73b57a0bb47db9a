"""BERT and T5 at TP=2 against the real megatron-core (0.16.1), two processes on gloo each side.

* megatron-core describes each TP rank's ``model.sharded_state_dict()`` (every tensor's key,
  global shape and global offset, every ``_extra_state`` object's key) for BERT and T5 at TP=2;
  this code base's ``model_sharded_state_dict`` of the same model on the same rank must
  describe the same.
* megatron-core writes a BERT checkpoint at TP=2; it loads here at TP=2 and at TP=1 (every
  tensor asked for is there, none left over), and the loss of one batch (masked LM over the
  real tokens + sentence order) equals megatron-core's own within 1e-5, fp32.

Run by ``make interop`` (needs $MCORE_PYTHON), not by ``make test``.
"""

import json
import os
import subprocess
from pathlib import Path

import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_layer_local_spec,
    get_t5_encoder_layer_local_spec,
)
from tests.harness import REPO
from tests.interop.test_model_families_layout import _config, _described
from tests.unit_tests.dist_utils import run_distributed

DRIVER = REPO / "tools" / "interop" / "mcore_gpt.py"
MCORE_PYTHON = os.environ.get("MCORE_PYTHON")
RTOL = 1e-5
LAYERS, VOCAB, SEQ = 2, 64, 16  # the rest as in test_model_families_layout._config


def _mcore_tp2(action, directory, out, *extra):
    command = [MCORE_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += ["2", str(DRIVER), action, str(directory), "--out", str(out)]
    command += ["--tensor-model-parallel-size", "2", "--num-layers", str(LAYERS)]
    command += [str(e) for e in extra]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # their `megatron`
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(Path(out).read_text())


def _bert(state):
    from megatron.core.models.bert.bert_model import BertModel

    torch.manual_seed(99)  # not the checkpoint's weights: a load must replace every one
    return BertModel(
        _config(state),
        2,
        bert_layer_local_spec,
        VOCAB,
        SEQ,
        share_embeddings_and_output_weights=True,
        pg_collection=state,
    )


def _t5(state):
    from megatron.core.models.T5.t5_model import T5Model

    return T5Model(
        _config(state),
        _config(state),
        get_t5_encoder_layer_local_spec(),
        get_t5_decoder_layer_local_spec(),
        VOCAB,
        SEQ,
        share_embeddings_and_output_weights=True,
        pg_collection=state,
    )


def _bert_loss(model):
    """The driver's bert_loss_of: the same batch (the same generator calls), the same loss."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    types = (torch.arange(SEQ) >= SEQ // 2).long().expand(2, -1).contiguous()
    padding = torch.ones(2, SEQ, dtype=torch.long)
    padding[1, -3:] = 0
    model.eval()
    with torch.no_grad():
        lm, binary = model(tokens, padding, tokentype_ids=types, lm_labels=labels)
    lm = (lm.float() * padding).sum() / padding.sum()
    return (lm + torch.nn.functional.cross_entropy(binary.float(), torch.tensor([0, 1]))).item()


def _entries(model, state):
    entries, _ = dc.model_sharded_state_dict(
        [model],
        state.get_tensor_model_parallel_rank(),
        state.get_tensor_model_parallel_world_size(),
    )
    return entries


def _load_strictly(model, state, directory):
    dc.load_shards(
        _entries(model, state),
        str(directory),
        strictness=dc.StrictHandling.RAISE_ALL,
        counts_as_unexpected=lambda key: True,  # the file holds the model only
    )


def _worker_tp2(rank, world, layouts, bert_checkpoint, expected):
    from megatron.core.parallel_state import initialize_model_parallel

    state = initialize_model_parallel(tensor_model_parallel_size=2)
    for family, build in (("bert", _bert), ("t5", _t5)):
        theirs = layouts[family]["ranks"][rank]
        ours = _described(_entries(build(state), state))
        assert ours["objects"] == theirs["objects"], family
        assert ours["tensors"] == sorted(theirs["tensors"]), family
        # A TP=2 layout, not the one-process one: the word embedding is split over the ranks.
        word = [t for t in ours["tensors"] if t[0] == "embedding.word_embeddings.weight"]
        assert word == [["embedding.word_embeddings.weight", [VOCAB, 32], [rank * VOCAB // 2, 0]]]

    model = _bert(state)
    _load_strictly(model, state, bert_checkpoint)
    loss = _bert_loss(model)
    assert abs(loss - expected) <= RTOL * abs(expected), ("TP=2", loss, expected)


def test_bert_and_t5_at_tp2_equal_megatron_core_and_its_tp2_bert_checkpoint_loads(tmp_path):
    from megatron.core.parallel_state import initialize_model_parallel

    layouts = {"t5": _mcore_tp2("describe", "-", tmp_path / "t5.json", "--family", "t5")}
    bert = ["--family", "bert", "--describe-to", tmp_path / "bert.json"]  # one start for both
    saved = _mcore_tp2("save", tmp_path / "mcore", tmp_path / "saved.json", *bert)
    layouts["bert"] = json.loads((tmp_path / "bert.json").read_text())
    directory = tmp_path / "mcore" / "iter_0000001"
    run_distributed(_worker_tp2, 2, layouts, str(directory), saved["loss"])

    state = initialize_model_parallel()  # one process: the TP=2 checkpoint at TP=1
    model = _bert(state)
    _load_strictly(model, state, directory)
    loss = _bert_loss(model)
    assert abs(loss - saved["loss"]) <= RTOL * abs(saved["loss"]), ("TP=1", loss, saved["loss"])
