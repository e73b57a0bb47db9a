"""--recompute-modules layernorm: the input and pre-MLP norms' outputs are freed once used and
recomputed in backward (Megatron's output-discarding checkpoint).

* Gradients: with dropout on, every combination with layernorm (alone, with mlp, with core_attn
  and mlp; also with the residual taken after the norm, which reads the norm's output in the
  residual add) gives the loss and gradients of the run without recompute bit for bit.
* Memory: after the forward, the storages autograd holds for backward are smaller by at least
  the 2 x layers norm outputs [s, b, h]; and the storages are refilled in backward (the
  gradients above could not be right otherwise).
* Tensor + sequence parallelism (TP=2, spawned gloo processes): each rank's loss and gradients
  equal those without recompute.
"""

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed

VOCAB, SEQ, BATCH, LAYERS, HIDDEN = 64, 32, 2, 3, 32


def _selective(*modules):
    return dict(recompute_granularity="selective", recompute_modules=list(modules))


def build(recompute, pg_collection=None, **config):
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        init_seed=1234,
        **recompute,
        **config,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        pg_collection=pg_collection,
    )
    return model.train()


def batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_and_grads(model, seed=11):
    tokens, labels = batch()
    torch.manual_seed(seed)
    loss = model(tokens, None, None, labels=labels).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("post_norm_residual", [False, True], ids=["pre_norm", "post_norm"])
@pytest.mark.parametrize(
    "modules",
    [("layernorm",), ("layernorm", "mlp"), ("core_attn", "layernorm", "mlp")],
    ids=["layernorm", "layernorm_mlp", "all"],
)
def test_layernorm_recompute_gives_identical_gradients(modules, post_norm_residual):
    extra = dict(apply_residual_connection_post_layernorm=post_norm_residual)
    ref_loss, ref_grads = loss_and_grads(build({}, **extra))
    loss, grads = loss_and_grads(build(_selective(*modules), **extra))
    assert torch.equal(loss, ref_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name


def held_bytes_after_forward(model) -> int:
    """Bytes of the distinct, still allocated storages autograd holds for backward once the
    forward is done (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []
    tokens, labels = batch()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(tokens, None, None, labels=labels).sum()
    held = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0 and storage.data_ptr() not in params:
            held[storage.data_ptr()] = storage.nbytes()
    loss.backward()
    return sum(held.values())


def test_layernorm_recompute_frees_the_norm_outputs():
    plain = held_bytes_after_forward(build({}))
    recomputed = held_bytes_after_forward(build(_selective("layernorm")))
    norm_outputs = 2 * LAYERS * SEQ * BATCH * HIDDEN * 4
    assert plain - recomputed >= norm_outputs, (plain, recomputed, norm_outputs)


def test_layernorm_recompute_is_off_in_eval_mode():
    tokens, labels = batch()
    with torch.no_grad():
        outputs = [
            build(recompute).eval()(tokens, None, None, labels=labels)
            for recompute in ({}, _selective("layernorm"))
        ]
    assert torch.equal(outputs[0], outputs[1])


def _tp_worker(rank, world_size):
    torch.set_num_threads(1)
    state = initialize_model_parallel(tensor_model_parallel_size=world_size)
    tracker = tp_random.RNGStatesTracker()
    results = []
    for recompute in ({}, _selective("layernorm", "mlp")):
        tracker.reset()
        tracker.add(tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, 1000 + rank)
        model = build(
            recompute,
            pg_collection=state,
            tensor_model_parallel_size=world_size,
            sequence_parallel=True,
            rng_tracker=tracker,
        )
        results.append(loss_and_grads(model))
    (ref_loss, ref_grads), (loss, grads) = results
    assert torch.equal(loss, ref_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name


def test_layernorm_recompute_under_tensor_and_sequence_parallelism():
    run_distributed(_tp_worker, 2)
