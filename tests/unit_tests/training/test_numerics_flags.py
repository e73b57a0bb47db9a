"""--init-method-xavier-uniform, --embedding-init-method-std, --openai-gelu,
--fp16-lm-cross-entropy and --fp32-residual-connection, from the command line to the model.

* Xavier: every weight matrix (embeddings included, Megatron's rule) is uniform in
  +-sqrt(6 / (fan_in + fan_out)) of its full, unsplit shape; the residual projections keep the
  scaled normal init; under TP=2 each rank holds the one-process shard.
* --embedding-init-method-std: the word and position embeddings take that std (also with
  Xavier for the rest), the other matrices keep --init-method-std.
* --openai-gelu: the MLP computes 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (float64
  formula), not the erf GeLU; it contradicts --swiglu.
* --fp16-lm-cross-entropy: the per-token losses of an fp16 model are fp16 and within two fp16
  ulps of the float64 cross entropy of its logits; without it they are fp32 and within 1e-5;
  the same at TP=2 (vocab-parallel cross entropy).
* --fp32-residual-connection: every layer of a bf16 model outputs fp32 and the logits are closer
  to the float64 evaluation of the same weights than without it.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.tensor_parallel import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import shard_of
from megatron.core.transformer.mlp import MLP
from megatron.training.arguments import ArgumentValidationError, parse_args, validate_args
from megatron.training.configs import core_transformer_config_from_args
from tests.harness.argv import megatron_argv
from tests.unit_tests.dist_utils import run_distributed

COMMAND_LINE = megatron_argv(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=16,
    seq_length=16,
    micro_batch_size=1,
    train_iters=1,
    vocab_size=128,
    hidden_dropout=0,
    attention_dropout=0,
)
VOCAB, SEQ = 256, 16


pytestmark = pytest.mark.usefixtures("single_process_env")


def args_of(*flags):
    return validate_args(parse_args(argv=COMMAND_LINE + [str(f) for f in flags]))


def model_of(*flags, tp=1, pg_collection=None, untie=True):
    args = args_of(*flags)
    args.tensor_model_parallel_size = tp
    config = core_transformer_config_from_args(args)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=not untie,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        # One process unless groups are given (GPTModel would take the current parallel_state's).
        pg_collection=pg_collection if pg_collection is not None else ProcessGroupCollection(),
    )


def xavier_bound(shape):
    return math.sqrt(6.0 / (shape[0] + shape[1]))


def test_xavier_uniform_init():
    model = model_of("--init-method-xavier-uniform")
    params = dict(model.named_parameters())
    for name in (
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.1.mlp.linear_fc1.weight",
        "output_layer.weight",
    ):
        w, bound = params[name].detach(), xavier_bound(params[name].shape)
        assert w.abs().max() <= bound and w.abs().max() > 0.97 * bound, name
        assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05), name
    proj = params["decoder.layers.0.self_attention.linear_proj.weight"].detach()
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.05)  # scaled normal


def test_embedding_init_std():
    for extra in ([], ["--init-method-xavier-uniform"]):
        params = dict(model_of("--embedding-init-method-std", 0.1, *extra).named_parameters())
        for name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
            assert params[name].std().item() == pytest.approx(0.1, rel=0.06), (name, extra)
        fc1 = params["decoder.layers.0.mlp.linear_fc1.weight"].detach()
        if extra:
            assert fc1.abs().max() <= xavier_bound(fc1.shape)
        else:
            assert fc1.std().item() == pytest.approx(0.02, rel=0.05)


def test_openai_gelu():
    # Without the bias-GeLU fusion (whose kernel is the tanh form too) plain GeLU would be erf.
    config = core_transformer_config_from_args(args_of("--openai-gelu", "--no-bias-gelu-fusion"))
    mlp = MLP(config)
    x = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(0)) * 3
    h = F.linear(x.double(), mlp.linear_fc1.weight.double(), mlp.linear_fc1.bias.double())
    act = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    expected = F.linear(act, mlp.linear_fc2.weight.double(), mlp.linear_fc2.bias.double())
    out, bias = mlp(x)
    out = out if bias is None else out + bias
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    erf = F.linear(F.gelu(h), mlp.linear_fc2.weight.double(), mlp.linear_fc2.bias.double())
    assert (erf - expected).abs().max() > 10 * (out.double() - expected).abs().max()
    with pytest.raises(ArgumentValidationError, match="--openai-gelu and --swiglu"):
        args_of("--openai-gelu", "--swiglu")


def _tokens():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(
        0, VOCAB, (2, SEQ), generator=g
    )


def fp16_losses(flag, tp=1, pg_collection=None):
    """Per-token losses of an fp16 model and the float64 cross entropy of its own logits."""
    flags = ["--fp16"] + (["--fp16-lm-cross-entropy"] if flag else [])
    model = model_of(*flags, tp=tp, pg_collection=pg_collection).half()
    tokens, labels = _tokens()
    losses = model(tokens, None, None, labels=labels)
    logits = model(tokens, None, None)
    if tp > 1:
        shards = [torch.empty_like(logits) for _ in range(tp)]
        group = pg_collection.get_tensor_model_parallel_group()
        torch.distributed.all_gather(shards, logits, group=group)
        logits = torch.cat(shards, dim=-1)
    reference = F.cross_entropy(
        logits.double().reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
    ).view(labels.shape)
    return losses, reference


def check_fp16_cross_entropy(tp=1, pg_collection=None):
    losses, reference = fp16_losses(True, tp, pg_collection)
    assert losses.dtype == torch.float16
    ulp = 2.0 ** (torch.floor(torch.log2(reference)) - 10)
    error = (losses.double() - reference).abs()
    assert (error <= 2 * ulp).all() and error.max() > 1e-4  # fp16 arithmetic, not fp32
    losses, reference = fp16_losses(False, tp, pg_collection)
    assert losses.dtype == torch.float32
    torch.testing.assert_close(losses.double(), reference, rtol=1e-5, atol=1e-5)


def test_fp16_lm_cross_entropy():
    check_fp16_cross_entropy()
    with pytest.raises(ArgumentValidationError, match="--fp16-lm-cross-entropy needs --fp16"):
        args_of("--fp16-lm-cross-entropy")


def test_fp32_residual_connection_keeps_the_residual_stream_in_fp32():
    errors = {}
    for flag in (False, True):
        flags = ["--bf16"] + (["--fp32-residual-connection"] if flag else [])
        args = args_of(*flags, "--num-layers", 6)
        model = GPTModel(
            core_transformer_config_from_args(args), get_gpt_layer_local_spec(), VOCAB, SEQ
        ).bfloat16()
        dtypes = []
        for layer in model.decoder.layers:
            layer.register_forward_hook(lambda m, i, out: dtypes.append(out[0].dtype))
        tokens, _ = _tokens()
        logits = model(tokens, None, None)
        assert dtypes == [torch.float32 if flag else torch.bfloat16] * 6
        exact = model.double()(tokens, None, None)
        errors[flag] = ((logits.double() - exact).norm() / exact.norm()).item()
    assert errors[True] < 0.8 * errors[False], errors


def _tp_worker(rank, world_size):
    torch.set_num_threads(1)
    state = initialize_model_parallel(tensor_model_parallel_size=world_size)
    check_fp16_cross_entropy(tp=world_size, pg_collection=state)
    single = dict(model_of("--init-method-xavier-uniform").named_parameters())
    model = model_of("--init-method-xavier-uniform", tp=world_size, pg_collection=state)
    for name, param in model.named_parameters():
        expected = single[name].detach()
        if getattr(param, "tensor_model_parallel", False):
            expected = shard_of(
                expected, param.partition_dim, rank, world_size, param.partition_stride
            )
        assert torch.equal(param.detach(), expected), name
    del model


def test_tensor_parallel_fp16_cross_entropy_and_xavier_shards(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    run_distributed(_tp_worker, 2)
