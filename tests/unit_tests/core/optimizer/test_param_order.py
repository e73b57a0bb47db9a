"""Parameter order: ours is megatron-core's registration order (the order torch optimizers and the
torch format pair state with parameters by), and torch-format checkpoints written here before,
in the older order (linear_qkv before linear_proj, pooler before binary_head), still resume."""

import argparse

import pytest
import torch

from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.T5.t5_model import T5Model
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_layer_local_spec,
    get_t5_encoder_layer_local_spec,
)
from megatron.core.optimizer.param_order import PARAM_ORDER_KEY, legacy_parameter_order
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import checkpointing
from tests.unit_tests.checkpoint_utils import checkpoint_args, setup_training_state

VOCAB, SEQ = 64, 8

# The order in which this code base built each module's children before: written out by hand from
# the old constructors (the test's independent account of the legacy order).
_OLD_SELF = ("linear_qkv", "q_layernorm", "k_layernorm", "core_attention", "linear_proj")
_OLD_CROSS = ("linear_q", "linear_kv", "core_attention", "linear_proj")
_OLD_BERT_HEADS = ("pooler", "binary_head")


def _moved_block(name):
    """(the module whose children were reordered, the child's old rank) for a parameter name."""
    for marker, order in ((".self_attention.", _OLD_SELF), (".cross_attention.", _OLD_CROSS)):
        if marker in name:
            prefix, rest = name.split(marker, 1)
            return prefix + marker, order.index(rest.split(".")[0])
    top = name.split(".")[0]
    if top in _OLD_BERT_HEADS:
        return "heads", _OLD_BERT_HEADS.index(top)
    return None, 0


def _old_names(names):
    """``names`` (current order) in the old order: within each run of one reordered module's
    parameters, sorted by the child's old rank."""
    out, i = [], 0
    while i < len(names):
        block = _moved_block(names[i])[0]
        j = i + 1
        while block is not None and j < len(names) and _moved_block(names[j])[0] == block:
            j += 1
        out += sorted(names[i:j], key=lambda n: _moved_block(n)[1])
        i = j
    return out


def _config(**overrides):
    settings = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    return TransformerConfig(**{**settings, **overrides})


def _families():
    state = initialize_model_parallel()
    moe = dict(
        num_moe_experts=2,
        moe_router_topk=1,
        moe_ffn_hidden_size=8,
        moe_shared_expert_intermediate_size=8,
        add_bias_linear=False,
    )
    return {
        "gpt_qk_layernorm_tied": GPTModel(
            _config(qk_layernorm=True),
            get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
        ),
        "moe": GPTModel(
            _config(**moe),
            get_gpt_layer_local_spec(num_experts=2),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            share_embeddings_and_output_weights=False,
        ),
        "bert": BertModel(
            _config(),
            2,
            bert_layer_local_spec,
            VOCAB,
            SEQ,
            share_embeddings_and_output_weights=True,
            pg_collection=state,
        ),
        "t5": T5Model(
            _config(),
            _config(),
            get_t5_encoder_layer_local_spec(),
            get_t5_decoder_layer_local_spec(),
            VOCAB,
            SEQ,
            share_embeddings_and_output_weights=True,
            pg_collection=state,
        ),
    }


def test_registration_order_is_megatron_cores_and_the_legacy_order_is_the_old_one():
    for family, model in _families().items():
        current = [name for name, _ in model.named_parameters()]
        name_of = {id(p): n for n, p in model.named_parameters()}
        # megatron-core's order (checked against megatron-core itself in tests/interop).
        qkv = [n for n in current if n.endswith("self_attention.linear_qkv.weight")]
        assert qkv, family
        for name in qkv:
            assert current.index(name.replace("linear_qkv", "linear_proj")) < current.index(name)
        legacy = [name_of[id(p)] for p in legacy_parameter_order([model])]
        assert legacy == _old_names(current), family
        assert legacy != current, family


def _gpt():
    torch.manual_seed(3)
    return GPTModel(
        _config(qk_layernorm=True),
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=False,
    )


def _train(model, opt, sched, first, last):
    losses = []
    for iteration in range(first, last + 1):
        g = torch.Generator().manual_seed(iteration)
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
        opt.zero_grad()
        ddp = hasattr(model, "finish_grad_sync")  # the distributed optimizer's DDP wrapper
        if ddp:
            model.zero_grad_buffer()
        loss = model(tokens, positions, None, labels=labels).float().mean()
        loss.backward()
        if ddp:
            model.finish_grad_sync()
        assert opt.step()[0]
        sched.step(2)
        losses.append(loss.item())
    return losses


def _as_written_before(path):
    """Rewrite the torch-format file at ``path`` as this code base wrote it before: optimizer
    state numbered in the old parameter order, no order mark."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        saved = torch.load(path, weights_only=True)
    assert saved.pop(PARAM_ORDER_KEY) == "megatron-core"
    named = list(_gpt().named_parameters())
    old_rank = {name: r for r, name in enumerate(_old_names([n for n, _ in named]))}
    # The optimizer's groups: weight decay on matrices, none on biases and 1-D parameters.
    no_decay = [n for n, p in named if n.endswith(".bias") or p.dim() == 1]
    groups = [[n for n, _ in named if n not in no_decay], no_decay]
    inner = saved["optimizer"].get("optimizer", saved["optimizer"])
    masters = saved["optimizer"].get("fp32_from_fp16_params")
    state, number = {}, 0
    for g, (group, names) in enumerate(zip(inner["param_groups"], groups)):
        ids = group["params"]
        assert len(ids) == len(names)
        order = sorted(range(len(ids)), key=lambda k: old_rank[names[k]])
        group["params"] = list(range(number, number + len(ids)))
        for k in order:
            state[number] = inner["state"][ids[k]]
            number += 1
        if masters is not None:
            masters[g] = [masters[g][k] for k in order]
    inner["state"] = state
    torch.save(saved, path)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_checkpoint_in_the_old_parameter_order_resumes_exactly(tmp_path, bf16):
    args = checkpoint_args(tmp_path, "torch", bf16=bf16)

    def make():
        model = _gpt()
        return model.to(torch.bfloat16) if bf16 else model

    model, opt, sched = setup_training_state(args, make, bf16=bf16)
    _train(model, opt, sched, 1, 2)
    checkpointing.save_checkpoint(2, model, opt, sched)
    straight = _train(model, opt, sched, 3, 4)

    path = tmp_path / "ckpt" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    _as_written_before(path)
    model2, opt2, sched2 = setup_training_state(args, make, bf16=bf16)
    assert checkpointing.load_checkpoint(model2, opt2, sched2)[0] == 2
    resumed = _train(model2, opt2, sched2, 3, 4)
    assert resumed == straight
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), name


def _distributed_setup(args):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.unit_tests.checkpoint_utils import make_scheduler, set_training_globals

    set_training_globals(args)
    model = _gpt()
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, weight_decay=0.1, use_distributed_optimizer=True), [ddp]
    )
    return ddp, opt, make_scheduler(opt)


def _distrib_optim_as_written_before(directory):
    """Rewrite distrib_optim.pt (one buffer, one bucket) as this code base laid it out before:
    the parameters in reverse old registration order, each starting at a multiple of 64
    elements; and drop the order mark from model_optim_rng.pt."""
    path = directory / "model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        saved = torch.load(path, weights_only=True)
    assert saved.pop(PARAM_ORDER_KEY) == "megatron-core"
    torch.save(saved, path)

    numel = {n: p.numel() for n, p in _gpt().named_parameters()}

    def starts(names):
        where, offset = {}, 0
        for name in names:
            where[name] = -(-offset // 64) * 64
            offset = where[name] + numel[name]
        return where, offset

    current_names = [n for n, _ in _gpt().named_parameters()]
    now, size = starts(list(reversed(current_names)))
    before, old_size = starts(list(reversed(_old_names(current_names))))
    state = torch.load(directory / "distrib_optim.pt", weights_only=True)
    (buckets,) = state[0].values()
    for key, (flat,) in buckets.items():
        assert flat.numel() == size
        old = torch.zeros(old_size)
        for name in current_names:
            old[before[name] : before[name] + numel[name]] = flat[
                now[name] : now[name] + numel[name]
            ]
        buckets[key] = [old]
    state["per_bucket_numel_unpadded"] = [{k: [old_size] for k in state[0]}]
    torch.save(state, directory / "distrib_optim.pt")


def test_a_distributed_optimizer_checkpoint_in_the_old_layout_resumes_exactly(tmp_path):
    args = checkpoint_args(tmp_path, "torch", use_distributed_optimizer=True)
    model, opt, sched = _distributed_setup(args)

    _train(model, opt, sched, 1, 2)
    checkpointing.save_checkpoint(2, model, opt, sched)
    straight = _train(model, opt, sched, 3, 4)

    _distrib_optim_as_written_before(tmp_path / "ckpt" / "iter_0000002" / "mp_rank_00")
    model, opt, sched = _distributed_setup(args)
    assert checkpointing.load_checkpoint(model, opt, sched)[0] == 2
    assert _train(model, opt, sched, 3, 4) == straight


def test_param_groups_in_megatron_cores_order_and_old_group_order_is_moved():
    # megatron-core lists the weight-decay group first even when a model's first parameter is a
    # norm (as on a later pipeline stage); this code base listed first the group of the first
    # parameter. A state saved in that order is moved back into place.
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1), [model])
        return model, opt

    model, opt = build()
    assert [g["wd_mult"] for g in opt.param_groups] == [1.0, 0.0]
    model(torch.randn(2, 8)).square().mean().backward()
    opt.step()
    saved = opt.state_dict()
    # As written before: the no-weight-decay group (LayerNorm weight and bias, Linear bias)
    # first, numbered from 0.
    decay, no_decay = saved["param_groups"]
    ids = no_decay["params"] + decay["params"]
    renumber = {old: new for new, old in enumerate(ids)}
    old_file = {
        "state": {renumber[i]: v for i, v in saved["state"].items()},
        "param_groups": [
            {**no_decay, "params": [renumber[i] for i in no_decay["params"]]},
            {**decay, "params": [renumber[i] for i in decay["params"]]},
        ],
    }
    model2, opt2 = build()
    legacy = {id(p): r for r, p in enumerate(legacy_parameter_order([model2]))}
    assert opt2.state_dict_in_current_order(saved, legacy) is None  # the current order fits
    moved = opt2.state_dict_in_current_order(old_file, legacy)
    opt2.load_state_dict(moved)
    for p, q in zip(model.parameters(), model2.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key])
