"""Activation recompute (--recompute-granularity full/selective) changes memory, not numerics.

* fp32 with dropout on (hidden and attention): every recompute choice gives the loss and the
  gradients of the run without recompute bit for bit (same seed), because the recomputed forward
  replays the CPU RNG state of the original one; a run with another dropout seed differs, so the
  comparison can fail.
* Activation memory, measured: the bytes of the distinct tensors autograd saves for backward
  during the forward of a GPTModel with labels (saved_tensors_hooks; parameters excluded), must be
  lower with recompute, in the expected order (none > selective core_attn > selective core_attn+mlp
  > full), and full uniform recompute with one layer per chunk must save far less than a layer's
  worth per layer.
* Tensor parallelism (TP=2, spawned gloo processes) with attention dropout and, under sequence
  parallelism, hidden dropout, both drawn from the RNG tracker's per-TP-rank stream: every
  recompute choice gives each rank's loss and gradients of the run without recompute bit for bit,
  because the recomputation also replays the tracker streams. Controls: skipping the tracker
  replay, or another tracker seed, changes the gradients.
* --distribute-saved-activations (TP=2, full recompute): same gradients, and each checkpointed
  chunk input is saved as 1/TP of its size (measured with saved_tensors_hooks).
"""

import re

import pytest
import torch

from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.harness.argv import megatron_argv
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tiny_configs import tiny_gpt_model, tiny_transformer_config

VOCAB, SEQ, BATCH, LAYERS, HIDDEN = 64, 32, 2, 4, 32

NONE = {}
SELECTIVE = dict(recompute_granularity="selective")
SELECTIVE_MLP = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
SELECTIVE_MLP_ONLY = dict(recompute_granularity="selective", recompute_modules=["mlp"])
FULL_UNIFORM_1 = dict(
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
)
FULL_UNIFORM_3 = dict(
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3
)
FULL_BLOCK_2 = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
FULL_BLOCK_ALL = dict(
    recompute_granularity="full", recompute_method="block", recompute_num_layers=LAYERS
)
FULL_BLOCK_0 = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=0)


pytestmark = pytest.mark.usefixtures("single_thread")


def build(recompute, dropout=0.1, **model_kwargs):
    config = tiny_transformer_config(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        **recompute,
    )
    model_kwargs.setdefault("position_embedding_type", "rope")
    model = tiny_gpt_model(
        config, seed=1234, vocab_size=VOCAB, max_sequence_length=SEQ, **model_kwargs
    )
    model.train()
    return model


def batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ), labels


def loss_and_grads(model, dropout_seed=11):
    tokens, pos, labels = batch()
    torch.manual_seed(dropout_seed)
    loss = model(tokens, pos, None, labels=labels).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(build(NONE))


@pytest.mark.parametrize(
    "recompute",
    [
        SELECTIVE,
        SELECTIVE_MLP,
        SELECTIVE_MLP_ONLY,
        FULL_UNIFORM_1,
        FULL_UNIFORM_3,
        FULL_BLOCK_2,
        FULL_BLOCK_ALL,
        FULL_BLOCK_0,
    ],
    ids=[
        "selective",
        "selective_mlp",
        "selective_mlp_only",
        "uniform1",
        "uniform3",
        "block2",
        "block_all",
        "block0",
    ],
)
def test_recompute_gives_bitwise_identical_loss_and_gradients(reference, recompute):
    ref_loss, ref_grads = reference
    loss, grads = loss_and_grads(build(recompute))
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name


def test_the_comparison_can_fail_dropout_is_really_on(reference):
    """Another dropout seed changes loss and gradients: the equality above is not vacuous."""
    ref_loss, ref_grads = reference
    loss, grads = loss_and_grads(build(FULL_UNIFORM_1), dropout_seed=12)
    assert not torch.equal(loss, ref_loss)
    assert not torch.equal(
        grads["decoder.layers.0.self_attention.linear_qkv.weight"],
        ref_grads["decoder.layers.0.self_attention.linear_qkv.weight"],
    )


def test_recompute_is_off_in_eval_mode():
    """Evaluation does not build a graph to recompute: same output as without recompute."""
    tokens, pos, labels = batch()
    outputs = []
    for recompute in (NONE, FULL_UNIFORM_1, SELECTIVE_MLP):
        model = build(recompute).eval()
        with torch.no_grad():
            outputs.append(model(tokens, pos, None, labels=labels))
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def _saved_bytes_hooks(model):
    """(dict storage -> bytes it fills, saved-tensor hooks that record into it), parameters
    excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes() > 0:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    return seen, (pack, lambda tensor: tensor)


def saved_activation_bytes(model) -> int:
    """Bytes of the distinct storages autograd saves for backward during one forward with labels
    (parameters excluded: they are not activations)."""
    seen, hooks = _saved_bytes_hooks(model)
    tokens, pos, labels = batch()
    torch.manual_seed(11)
    with torch.autograd.graph.saved_tensors_hooks(*hooks):
        loss = model(tokens, pos, None, labels=labels).sum()
    loss.backward()  # the graph is complete and usable
    return sum(seen.values())


@pytest.fixture(scope="module")
def saved():
    cases = {
        "none": NONE,
        "selective": SELECTIVE,
        "selective_mlp": SELECTIVE_MLP,
        "uniform1": FULL_UNIFORM_1,
        "uniform3": FULL_UNIFORM_3,
        "block2": FULL_BLOCK_2,
        "block_all": FULL_BLOCK_ALL,
        "block0": FULL_BLOCK_0,
    }
    return {name: saved_activation_bytes(build(recompute)) for name, recompute in cases.items()}


def test_recompute_saves_less_activation_memory(saved):
    assert saved["block0"] == saved["none"]  # block with 0 layers recomputes nothing
    assert saved["selective"] < saved["none"]
    assert saved["selective_mlp"] < saved["selective"]
    assert saved["uniform1"] < saved["selective_mlp"]
    assert saved["block2"] < saved["none"] and saved["block_all"] < saved["block2"]
    assert saved["uniform3"] < saved["none"]
    # uniform with chunks of 3 layers over 4 layers keeps 2 chunk inputs, chunks of 1 keep 4.
    assert saved["uniform3"] < saved["uniform1"]
    assert saved["block_all"] == saved["uniform1"]  # both checkpoint every layer on its own


def test_full_recompute_keeps_about_one_hidden_state_per_layer(saved):
    """Per layer, full recompute of every layer saves (besides the embedding, final norm and loss
    that both runs save) one [s, b, h] fp32 input; without recompute a layer saves > 10 of them."""
    hidden_state = SEQ * BATCH * HIDDEN * 4
    layers_none = saved["none"] - saved["block_all"] + LAYERS * hidden_state
    per_layer_none = layers_none / LAYERS
    assert per_layer_none > 10 * hidden_state
    # Removing the recompute of one layer (block 2 vs all 4) adds two layers' activations back.
    assert saved["block2"] - saved["block_all"] == pytest.approx(
        2 * (per_layer_none - hidden_state), rel=0.05
    )


# ------------------------------------------------------------------ tensor parallelism (TP=2)
def _build_tp(recompute, tp_state, tracker, sp=False, distribute=False):
    config = tiny_transformer_config(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        tensor_model_parallel_size=2,
        sequence_parallel=sp,
        distribute_saved_activations=distribute,
        **recompute,
    )
    model = tiny_gpt_model(
        config,
        seed=1234,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        pg_collection=tp_state,
    )
    config.rng_tracker = tracker
    model.train()
    return model


def _tp_loss_and_grads(model, tracker, tp_rank, tracker_seed=1234, hooks=None):
    tokens, pos, labels = batch()
    tp_random.model_parallel_manual_seed(tracker, tracker_seed, tp_rank=tp_rank)
    torch.manual_seed(11)
    if hooks is None:
        loss = model(tokens, pos, None, labels=labels).sum()
    else:
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            loss = model(tokens, pos, None, labels=labels).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(result, reference, tag):
    loss, grads = result
    ref_loss, ref_grads = reference
    assert torch.equal(loss, ref_loss), f"{tag}: loss {loss} vs {ref_loss}"
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), f"{tag}: gradient of {name}"


def _tp_worker(rank, world_size):
    from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel

    torch.set_num_threads(1)
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    tp_rank = state.get_tensor_model_parallel_rank()
    tracker = tp_random.RNGStatesTracker("cpu")
    all_choices = (
        ("selective", SELECTIVE),
        ("selective_mlp", SELECTIVE_MLP),
        ("uniform1", FULL_UNIFORM_1),
        ("uniform3", FULL_UNIFORM_3),
        ("block2", FULL_BLOCK_2),
    )
    for sp, choices in ((False, all_choices), (True, all_choices[1:3])):
        reference = _tp_loss_and_grads(_build_tp(NONE, state, tracker, sp), tracker, tp_rank)
        for name, recompute in choices:
            model = _build_tp(recompute, state, tracker, sp)
            _assert_same(_tp_loss_and_grads(model, tracker, tp_rank), reference, f"sp={sp} {name}")

    # Controls: the tracker stream really drives dropout, and replaying it is what makes the
    # recomputed masks equal (the first layer's QKV gradient sees every later layer's dropout).
    reference = _tp_loss_and_grads(_build_tp(NONE, state, tracker), tracker, tp_rank)
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    _, other_seed = _tp_loss_and_grads(
        _build_tp(FULL_UNIFORM_1, state, tracker), tracker, tp_rank, tracker_seed=99
    )
    assert not torch.equal(other_seed[key], reference[1][key])
    restore = tp_random.RNGSnapshot.restore

    def restore_without_tracker(snapshot):
        tracker_ = snapshot.tracker
        snapshot.tracker = None
        try:
            restore(snapshot)
        finally:
            snapshot.tracker = tracker_

    tp_random.RNGSnapshot.restore = restore_without_tracker
    try:
        _, unreplayed = _tp_loss_and_grads(
            _build_tp(FULL_UNIFORM_1, state, tracker), tracker, tp_rank
        )
    finally:
        tp_random.RNGSnapshot.restore = restore
    assert not torch.equal(unreplayed[key], reference[1][key])

    # --distribute-saved-activations: same numerics, chunk inputs saved as 1/TP.
    saved = {}
    for distribute in (False, True):
        for name, recompute in (("uniform1", FULL_UNIFORM_1), ("block2", FULL_BLOCK_2)):
            model = _build_tp(recompute, state, tracker, distribute=distribute)
            seen, hooks = _saved_bytes_hooks(model)
            _assert_same(
                _tp_loss_and_grads(model, tracker, tp_rank, hooks=hooks),
                reference,
                f"distribute={distribute} {name}",
            )
            saved[distribute, name] = sum(seen.values())
    hidden_state = SEQ * BATCH * HIDDEN * 4  # one fp32 [s, b, h] chunk input
    for name, checkpoints in (("uniform1", LAYERS), ("block2", 2)):
        assert saved[False, name] - saved[True, name] == checkpoints * hidden_state // 2, name
    destroy_model_parallel()


def test_tp2_recompute_with_dropout_and_distributed_saved_activations_match():
    run_distributed(_tp_worker, 2)


def test_distribute_saved_activations_needs_full_recompute():
    with pytest.raises(
        ValueError, match="distribute-saved-activations.*recompute-granularity full"
    ):
        TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            distribute_saved_activations=True,
            recompute_granularity="selective",
        )


# ------------------------------------------------------------------ flags
_ARGV = megatron_argv(max_position_embeddings=128)


def _validate(monkeypatch, *extra, world_size=2):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    return validate_args(parse_args(argv=_ARGV + [str(a) for a in extra]))


def test_recompute_flags_with_tensor_parallel_dropout(monkeypatch):
    from megatron.training.arguments import ArgumentValidationError

    full = [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        1,
    ]
    tp2 = ["--tensor-model-parallel-size", 2, "--attention-dropout", 0.1, "--hidden-dropout", 0.1]
    # Accepted: recomputation replays the RNG tracker's streams, so the recomputed dropout
    # masks are the forward's.
    assert (
        _validate(
            monkeypatch, *tp2, "--sequence-parallel", "--recompute-activations"
        ).recompute_granularity
        == "selective"
    )
    assert _validate(
        monkeypatch, *tp2, *full, "--distribute-saved-activations"
    ).distribute_saved_activations
    for extra, message in (
        (
            (*tp2, *full, "--distribute-saved-activations", "--sequence-parallel"),
            "--distribute-saved-activations cannot be used with --sequence-parallel",
        ),
        (
            (*tp2, "--recompute-activations", "--distribute-saved-activations"),
            "--distribute-saved-activations needs --recompute-granularity full (got selective)",
        ),
        (
            (*full, "--distribute-saved-activations"),
            "--distribute-saved-activations needs --tensor-model-parallel-size > 1",
        ),
    ):
        with pytest.raises(ArgumentValidationError, match=re.escape(message)):
            _validate(
                monkeypatch, *extra, world_size=2 if "--tensor-model-parallel-size" in extra else 1
            )
