"""Megatron Core as a library (issue #32): a training loop written only against the public API
(tests/functional_tests/library_loop.py) trains GPT at TP2 x PP2 with the distributed optimizer
and gives pretrain_gpt.py's losses on the same flags, iteration for iteration.

One spawned world of 4 processes runs both: pretrain_gpt.py in-process first (its losses read at
full precision from what training_log receives on the last rank), then the loop. Same model,
seeds, data order and arithmetic, so the losses must be equal bitwise.
"""

import ast
import contextlib
import inspect
import io
import json
import os
import sys

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from tests.functional_tests import library_loop
from tests.functional_tests.runner import REPO
from tests.unit_tests.dist_utils import run_distributed

HP = library_loop.Hyperparameters()


def _pretrain_losses(argv):
    """'lm loss' of every iteration, as training_log receives it on this rank (none on others)."""
    sys.path.insert(0, str(REPO))
    import pretrain_gpt
    from megatron.training import global_vars, training

    received = []
    real = training.training_log
    names = list(inspect.signature(real).parameters)

    def spy(*args, **kwargs):
        given = {**dict(zip(names, args)), **kwargs}
        if "lm loss" in given["loss_dict"]:
            received.append(float(given["loss_dict"]["lm loss"]))
        return real(*args, **kwargs)

    training.training_log = spy
    global_vars.reset_globals()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            pretrain_gpt.pretrain(
                pretrain_gpt.train_valid_test_datasets_provider,
                pretrain_gpt.model_provider,
                pretrain_gpt.ModelType.encoder_or_decoder,
                pretrain_gpt.forward_step,
                argv=argv,
            )
    finally:
        training.training_log = real
        global_vars.reset_globals()
    return received


def _tied_embedding_copied_by_the_constructor():
    """megatron-core's rule, which the loop relies on: at PP > 1 the last stage's copy of a tied
    word embedding leaves GPTModel's constructor equal to the first stage's."""
    parallel_state.initialize_model_parallel(2, 2)
    model = library_loop.model_provider(HP, library_loop.padded_vocab_size(HP.vocab_size + 1, 2))
    weight = model.shared_embedding_or_output_weight().detach()
    ends = [torch.empty_like(weight) for _ in range(2)]
    dist.all_gather(ends, weight, group=parallel_state.get_embedding_group())
    assert torch.equal(ends[0], ends[1]) and ends[0].abs().sum() > 0
    parallel_state.destroy_model_parallel()


def _both(rank, world_size, path):
    _tied_embedding_copied_by_the_constructor()
    reference = _pretrain_losses(HP.as_flags())
    parallel_state.destroy_model_parallel()
    loop = library_loop.train(HP, torch.device("cpu"))
    if rank == world_size - 1:  # the last pipeline stage
        with open(path, "w") as f:
            json.dump({"pretrain": reference, "loop": loop}, f)


def test_library_loop_imports_only_megatron_core():
    tree = ast.parse(inspect.getsource(library_loop))
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [None])
    ]
    megatron = [name for name in imported if name.split(".")[0] == "megatron"]
    assert megatron and all(name.startswith("megatron.core") for name in megatron), imported


def test_library_loop_equals_pretrain_gpt_at_tp2_pp2_with_distributed_optimizer(tmp_path):
    path = os.path.join(tmp_path, "losses.json")
    run_distributed(_both, 4, path)
    with open(path) as f:
        losses = json.load(f)
    assert len(losses["pretrain"]) == HP.train_iters, losses
    # It trains (a falling loss), so equal lists are not two untrained constants.
    assert losses["pretrain"][-1] < losses["pretrain"][0] - 0.1, losses
    assert losses["loop"] == losses["pretrain"], losses
