"""Megatron-LM's torch_dist layout for the other model families: MoE GPT (the expert axis),
BERT and T5 (the blocks' prefixes, cross-attention, the output layer's extra state); and GPT and
MoE GPT checkpoints in the older per-layer keys still resuming.

The keys are the ones megatron-core 0.16.1 writes (compared with the real megatron-core in
tests/interop/test_model_families_layout.py); here, without it: the rows on our side, save and
load round trips, and MoE checkpoints written before the expert axis (one key per layer) still
resuming.
"""

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.mapping import replicated, tensor_parallel_sharded
from megatron.core.dist_checkpointing.megatron_layout import (
    is_per_layer_layout,
    to_megatron_layout,
    unstack,
)
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_layer_local_spec,
    get_t5_encoder_layer_local_spec,
)
from megatron.training import checkpointing, checkpointing_dist
from tests.unit_tests.checkpointing.test_dist_checkpointing import _iter_dir, _setup, _train_gpt
from tests.unit_tests.tiny_configs import (
    tiny_gpt_model,
    tiny_transformer_config,
)


def test_experts_of_an_expert_parallel_rank_get_the_global_expert_axis():
    # Expert-parallel rank 1 of 2 (experts 2 and 3 of 4) and expert-tensor-parallel rank 1 of 2
    # of layer 1 of a 2-layer model; SwiGLU's fc1 ([gate; up], stride 2) of 2 x 6 rows per rank.
    h, ffn, etp = 4, 12, 2
    entries = {}
    for e in (2, 3):
        fc1 = torch.randn(2 * ffn // etp, h)
        key = f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"
        entries[key] = tensor_parallel_sharded(key, fc1, 0, 1, etp, stride=2)
        entries[key].expert = True
    for key in ("decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.1.mlp.router.weight"):
        entries[key] = replicated(key, torch.randn(4 if "router" in key else h, h)[0])
    out, by_old, objects = to_megatron_layout(
        entries,
        {"decoder.layers.": 2},
        writes_extra_state=True,
        num_experts=4,
        writes_expert_extra_state=False,
    )
    stacked = [e for e in out.values() if e.key.endswith("experts.experts.linear_fc1.weight")]
    assert [e.key for e in stacked] == ["decoder.layers.mlp.experts.experts.linear_fc1.weight"] * 2
    assert all(e.global_shape == (2, 4, 2 * ffn, h) and e.expert for e in stacked)
    # Rank 1's rows of the gate (6..11) and of the up projection (18..23), at layer 1, expert e.
    for e, entry in zip((2, 3), stacked):
        assert [c.global_offset for c in entry.chunks] == [(1, e, 6, 0), (1, e, 18, 0)]
        assert all(c.shape == (1, 1, 6, h) for c in entry.chunks)
        old = entries[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"]
        assert by_old[old.key] is entry and entry.data.data_ptr() == old.data.data_ptr()
    # A MoE layer's pre-MLP norm has Megatron's fused name too; the router is stacked by layer.
    assert by_old["decoder.layers.1.pre_mlp_layernorm.weight"].key == (
        "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    )
    router = by_old["decoder.layers.1.mlp.router.weight"]
    assert router.key == "decoder.layers.mlp.router.weight" and router.global_shape == (2, 4)
    assert {(o.unique_key, o.replica, o.expert) for o in objects} == {
        (f"decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.{e}_2.4", True, True)
        for e in (2, 3)
    }
    with pytest.raises(ValueError, match=r"local_experts\.2\.linear_fc1\.weight: expert 2 outside"):
        to_megatron_layout(entries, {"decoder.layers.": 2}, True, num_experts=2)


class _Block(torch.nn.Module):
    """A 2-layer decoder whose MLPs are only the experts (with a TransformerBlock's attributes
    as model_sharded_state_dict reads them)."""

    def __init__(self, config, make_experts):
        super().__init__()
        self.config = config
        self.layer_number_offset = 0
        self.layers = torch.nn.ModuleList()
        for _ in range(2):
            layer = torch.nn.Module()
            layer.mlp = torch.nn.Module()
            layer.mlp.experts = make_experts()
            self.layers.append(layer)


def _experts_chunk(ep_rank, ep_size):
    from megatron.core.transformer.moe.experts import SequentialMLP

    torch.manual_seed(3)  # every rank draws all experts' weights and keeps its own
    chunk = torch.nn.Module()
    chunk.decoder = _Block(_moe_config(), lambda: SequentialMLP(_moe_config(), ep_rank, ep_size))
    return chunk


def test_expert_parallel_rank_writes_its_experts_at_their_global_index(tmp_path):
    # Written by one process holding all 4 experts, read by expert-parallel rank 1 of 2 (its
    # local experts 0 and 1 are the model's experts 2 and 3).
    whole = _experts_chunk(0, 1)
    entries, _ = dc.model_sharded_state_dict([whole])
    dc.save_shards(entries, str(tmp_path / "ckpt"))
    dc.write_metadata_json(str(tmp_path / "ckpt"))
    rank1 = _experts_chunk(1, 2)
    for p in rank1.parameters():
        torch.nn.init.zeros_(p)
    entries, _ = dc.model_sharded_state_dict([rank1])
    fc1 = [e for e in entries.values() if e.key.endswith("experts.experts.linear_fc1.weight")]
    pairs = [(layer, e) for layer in (0, 1) for e in (2, 3)]
    assert [e.chunks[0].global_offset[:2] for e in fc1] == pairs
    objects = {e.unique_key for e in entries.values() if isinstance(e, dc.ShardedObject)}
    assert objects == {
        f"decoder.layers.mlp.experts.experts.linear_fc{i}._extra_state/shard_{layer}.{e}_2.4"
        for i in (1, 2)
        for layer, e in pairs
    }
    dc.load_shards(entries, str(tmp_path / "ckpt"))
    for layer, expert in pairs:
        mine = rank1.decoder.layers[layer].mlp.experts.local_experts[expert - 2]
        full = whole.decoder.layers[layer].mlp.experts.local_experts[expert]
        for name in ("linear_fc1.weight", "linear_fc2.weight"):
            got = mine.get_parameter(name)
            assert torch.equal(got, full.get_parameter(name)), (layer, expert, name)


def _moe_config():
    return tiny_transformer_config(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=8,
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        add_bias_linear=False,
    )


def _mla_config():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        q_lora_rank=8,
        kv_lora_rank=12,
        qk_head_dim=4,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        qk_layernorm=True,
        add_bias_linear=False,
    )


def test_mla_gpt_writes_megatron_keys():
    # Megatron's Transformer Engine spec fuses the latent norms into the up projections; the
    # input norm stays a module of its own (no linear_qkv to fuse it into).
    model = tiny_gpt_model(_mla_config())
    entries, _ = dc.model_sharded_state_dict([model])
    shapes = {e.key: e.global_shape for e in entries.values() if isinstance(e, dc.ShardedTensor)}
    attention = {k: v for k, v in shapes.items() if k.startswith("decoder.layers.self_attention.")}
    assert attention == {
        "decoder.layers.self_attention.linear_proj.weight": (2, 32, 24),
        "decoder.layers.self_attention.linear_q_down_proj.weight": (2, 8, 32),
        "decoder.layers.self_attention.linear_q_up_proj.weight": (2, 32, 8),
        "decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight": (2, 8),
        "decoder.layers.self_attention.linear_kv_down_proj.weight": (2, 16, 32),
        "decoder.layers.self_attention.linear_kv_up_proj.weight": (2, 40, 12),
        "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight": (2, 12),
    }
    assert "decoder.layers.input_layernorm.weight" in shapes
    objects = {e.unique_key for e in entries.values() if isinstance(e, dc.ShardedObject)}
    modules = ["linear_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj"]
    modules += ["linear_kv_up_proj"]
    assert {
        f"decoder.layers.self_attention.{m}._extra_state/shard_{layer}_2"
        for m in modules
        for layer in (0, 1)
    } <= objects


def test_moe_gpt_writes_megatron_keys():
    model = tiny_gpt_model(_moe_config())
    entries, by_param = dc.model_sharded_state_dict([model])
    shapes = {e.key: e.global_shape for e in entries.values() if isinstance(e, dc.ShardedTensor)}
    layer_keys = {k: v for k, v in shapes.items() if k.startswith("decoder.layers.")}
    assert layer_keys == {
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 32),
        "decoder.layers.self_attention.linear_qkv.layer_norm_bias": (2, 32),
        "decoder.layers.self_attention.linear_qkv.weight": (2, 96, 32),
        "decoder.layers.self_attention.linear_proj.weight": (2, 32, 32),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 32),
        "decoder.layers.mlp.linear_fc1.layer_norm_bias": (2, 32),
        "decoder.layers.mlp.router.weight": (2, 4, 32),
        "decoder.layers.mlp.router.expert_bias": (2, 4),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (2, 4, 16, 32),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (2, 4, 32, 16),
        "decoder.layers.mlp.shared_experts.linear_fc1.weight": (2, 8, 32),
        "decoder.layers.mlp.shared_experts.linear_fc2.weight": (2, 32, 8),
    }
    objects = {e.unique_key for e in entries.values() if isinstance(e, dc.ShardedObject)}
    per_layer = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    per_layer += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    expected = {
        f"decoder.layers.{m}._extra_state/shard_{layer}_2" for m in per_layer for layer in (0, 1)
    }
    expected |= {
        f"decoder.layers.mlp.experts.experts.linear_fc{i}._extra_state/shard_{layer}.{e}_2.4"
        for i in (1, 2)
        for layer in (0, 1)
        for e in range(4)
    }
    assert objects == expected
    fc2 = model.decoder.layers[1].mlp.experts.local_experts[3].linear_fc2.weight
    assert by_param[id(fc2)].chunks[0].global_offset == (1, 3, 0, 0)
    # The offline tools read it back under our per-layer names, with the shapes of ours.
    full = {k: torch.zeros(v) for k, v in layer_keys.items()}
    ours = {k: v.shape for k, v in model.state_dict().items() if k.startswith("decoder.layers.")}
    assert {k: v.shape for k, v in unstack(full).items()} == ours


# Checkpoints written here before the Megatron layout keyed each layer (and each expert) on its
# own: they must still resume, model and optimizer. Per model: its config, then one layer's key
# in the old per-layer layout and in Megatron's.
RESUME_MODELS = {
    "gpt": (
        lambda: None,
        "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    ),
    "moe": (
        _moe_config,
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
        "decoder.layers.mlp.experts.experts.linear_fc1.weight",
    ),
    "mla": (
        _mla_config,
        "decoder.layers.1.self_attention.kv_layernorm.weight",
        "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight",
    ),
}


@pytest.mark.parametrize("per_layer", [True, False], ids=["old-per-layer-keys", "megatron-keys"])
@pytest.mark.parametrize("family", list(RESUME_MODELS))
def test_checkpoint_resumes_exactly_in_either_key_layout(tmp_path, monkeypatch, family, per_layer):
    make_config, old_key, megatron_key = RESUME_MODELS[family]
    model, opt, sched = _setup(tmp_path, model=tiny_gpt_model(make_config(), seed=0))
    _train_gpt(model, opt, sched, 2, seed=1)
    if per_layer:
        writer = checkpointing_dist._sharded_model
        monkeypatch.setattr(
            checkpointing_dist,
            "_sharded_model",
            lambda m, s, megatron_layout=True: writer(m, s, megatron_layout=False),
        )
    checkpointing.save_checkpoint(2, model, opt, sched, 0.0)
    monkeypatch.undo()
    keys = set(dc.tensor_shapes(dc.read_dcp_metadata(str(_iter_dir(tmp_path, 2)))))
    layer_key = old_key if per_layer else megatron_key
    assert {layer_key, "optimizer.state.exp_avg." + layer_key} <= keys
    straight = _train_gpt(model, opt, sched, 2, seed=2)

    model2, opt2, sched2 = _setup(tmp_path, model=tiny_gpt_model(make_config(), seed=5))
    assert checkpointing.load_checkpoint(model2, opt2, sched2)[0] == 2
    assert _train_gpt(model2, opt2, sched2, 2, seed=2) == straight
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("per_layer", [True, False], ids=["old-per-layer-keys", "megatron-keys"])
def test_moe_gpt_mixing_dense_and_moe_layers_is_keyed_layer_by_layer(tmp_path, per_layer):
    # megatron-core keys the layers of such a model one by one (decoder.layers.<l>.), Megatron's
    # names within, the experts on an axis of their own and one-object _extra_state grids.
    config = _moe_config()
    config.moe_layer_freq = [1, 0]
    model = tiny_gpt_model(config, seed=0)
    entries, _ = dc.model_sharded_state_dict([model], megatron_layout=not per_layer)
    if not per_layer:
        shapes = {
            e.key: e.global_shape for e in entries.values() if isinstance(e, dc.ShardedTensor)
        }
        layers = {k: v for k, v in shapes.items() if k.startswith("decoder.layers.")}
        attention = {
            "self_attention.linear_qkv.layer_norm_weight": (32,),
            "self_attention.linear_qkv.layer_norm_bias": (32,),
            "self_attention.linear_qkv.weight": (96, 32),
            "self_attention.linear_proj.weight": (32, 32),
            "mlp.linear_fc1.layer_norm_weight": (32,),
            "mlp.linear_fc1.layer_norm_bias": (32,),
        }
        moe = {
            "mlp.router.weight": (4, 32),
            "mlp.router.expert_bias": (4,),
            "mlp.experts.experts.linear_fc1.weight": (4, 16, 32),
            "mlp.experts.experts.linear_fc2.weight": (4, 32, 16),
            "mlp.shared_experts.linear_fc1.weight": (8, 32),
            "mlp.shared_experts.linear_fc2.weight": (32, 8),
        }
        dense = {"mlp.linear_fc1.weight": (128, 32), "mlp.linear_fc2.weight": (32, 128)}  # 4h
        assert layers == {f"decoder.layers.0.{k}": v for k, v in {**attention, **moe}.items()} | {
            f"decoder.layers.1.{k}": v for k, v in {**attention, **dense}.items()
        }
        objects = {e.unique_key for e in entries.values() if isinstance(e, dc.ShardedObject)}
        attn = ["self_attention.linear_qkv", "self_attention.linear_proj"]
        shared = ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
        expected = {f"decoder.layers.0.{m}._extra_state/shard_0_1" for m in attn + shared}
        expected |= {
            f"decoder.layers.0.mlp.experts.experts.linear_fc{i}._extra_state/shard_{e}_4"
            for i in (1, 2)
            for e in range(4)
        }
        expected |= {
            f"decoder.layers.1.{m}._extra_state/shard_0_1"
            for m in attn + ["mlp.linear_fc1", "mlp.linear_fc2"]
        }
        assert objects == expected
        full = {k: torch.zeros(v) for k, v in layers.items()}
        ours = {k: v.shape for k, v in model.state_dict().items() if k.startswith("decoder.")}
        ours = {k: v for k, v in ours.items() if "final_layernorm" not in k}
        assert {k: v.shape for k, v in unstack(full).items()} == ours
    dc.save_shards(entries, str(tmp_path / "ckpt"))
    dc.write_metadata_json(str(tmp_path / "ckpt"))
    keys = set(dc.tensor_shapes(dc.read_dcp_metadata(str(tmp_path / "ckpt"))))
    assert is_per_layer_layout(keys) == per_layer
    # Loaded as the trainer does: in the layout the checkpoint's keys say.
    other = tiny_gpt_model(config, seed=1)
    loaded, _ = dc.model_sharded_state_dict([other], megatron_layout=not per_layer)
    dc.load_shards(loaded, str(tmp_path / "ckpt"), strictness=dc.StrictHandling.RAISE_ALL)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


def _bert(seed):
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.parallel_state import initialize_model_parallel

    torch.manual_seed(seed)
    return BertModel(
        tiny_transformer_config(),
        2,
        bert_layer_local_spec,
        64,
        16,
        share_embeddings_and_output_weights=True,
        pg_collection=initialize_model_parallel(),
    )


def _t5(seed):
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.parallel_state import initialize_model_parallel

    torch.manual_seed(seed)
    config = tiny_transformer_config()
    return T5Model(
        config,
        config,
        get_t5_encoder_layer_local_spec(),
        get_t5_decoder_layer_local_spec(),
        64,
        16,
        share_embeddings_and_output_weights=True,
        pg_collection=initialize_model_parallel(),
    )


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_bert_and_t5_rows_and_round_trip(tmp_path, family):
    make = _bert if family == "bert" else _t5
    model = make(0)
    entries, _ = dc.model_sharded_state_dict([model])
    objects = {e.unique_key for e in entries.values() if isinstance(e, dc.ShardedObject)}
    keys = {e.key for e in entries.values() if isinstance(e, dc.ShardedTensor)}
    modules = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    modules += ["mlp.linear_fc1", "mlp.linear_fc2"]
    blocks = {"encoder": modules}
    if family == "t5":
        cross = ["cross_attention.linear_q", "cross_attention.linear_kv"]
        blocks["decoder"] = modules + cross + ["cross_attention.linear_proj"]
    expected = {
        f"{b}.layers.{m}._extra_state/shard_{layer}_2"
        for b, ms in blocks.items()
        for m in ms
        for layer in (0, 1)
    }
    # megatron-core's T5 also keeps its LM head's output layer, and the embedding's position
    # table, under second names.
    heads = ["output_layer"] if family == "bert" else ["lm_head.output_layer", "output_layer"]
    expected |= {f"{head}._extra_state/shard_0_1" for head in heads}
    assert objects == expected
    assert {f"{b}.layers.mlp.linear_fc1.layer_norm_weight" for b in blocks} <= keys
    assert not any(".layers.0." in k or ".layers.1." in k for k in keys)
    aliases = {e.key for e in entries.values() if getattr(e, "optional", False)}
    assert aliases == (
        set() if family == "bert" else {"position_embeddings.weight", "output_layer.bias"}
    )

    # Written with the aliases, and (as before they were written) without: both load.
    for name, written in (("ckpt", entries), ("no_alias", {})):
        written = written or {k: e for k, e in entries.items() if e.key not in aliases}
        dc.save_shards(written, str(tmp_path / name))
        dc.write_metadata_json(str(tmp_path / name))
        other = make(1)
        loaded, _ = dc.model_sharded_state_dict([other])
        dc.load_shards(loaded, str(tmp_path / name), strictness=dc.StrictHandling.RAISE_ALL)
        mine, theirs = model.state_dict(), other.state_dict()
        assert sorted(mine) == sorted(theirs)
        for key, tensor in mine.items():
            assert torch.equal(tensor, theirs[key]), (name, key)
