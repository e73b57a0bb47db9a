"""The torch_dist layout of MoE GPT, BERT and T5 against the real megatron-core (0.16.1).

megatron-core runs in its own environment through ``tools/interop/mcore_gpt.py`` (see
test_megatron_core_interop.py and ``make interop``). For each family, megatron-core describes
its ``model.sharded_state_dict()`` (every tensor's key, global shape and global offset, every
``_extra_state`` object's key) and this code base's ``model_sharded_state_dict`` of the same
model must describe the same checkpoint, and list its parameters in the same order (dense GPT
too). For MoE GPT, megatron-core also writes a checkpoint
that this code base loads at EP=2 (every tensor asked for, none left) and gives megatron-core's
loss on the same batch; and megatron-core loads a MoE checkpoint written here, every tensor
equal, with this code base's loss (and its torch-format ``_extra_state`` entries are ours).
BERT and T5 checkpoints go both ways, every tensor equal; megatron-core's T5 checkpoint gives
its loss here (the driver builds its T5 with the final norms it has under Transformer Engine).
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
from tests.unit_tests.dist_utils import run_distributed

DRIVER = REPO / "tools" / "interop" / "mcore_gpt.py"
MCORE_PYTHON = os.environ.get("MCORE_PYTHON")
RTOL = 1e-5

LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 2, 32, 4, 64, 16
EXPERTS, MOE_FFN, SHARED_FFN = 4, 24, 16
MOE_FLAGS = ["--num-experts", EXPERTS, "--moe-ffn-hidden-size", MOE_FFN]
MOE_FLAGS += ["--moe-shared-expert-intermediate-size", SHARED_FFN, "--disable-bias-linear"]
MOE_FLAGS += ["--moe-shared-expert-gate", "--moe-router-enable-expert-bias"]


def _mcore(action, directory, out, *extra):
    command = [MCORE_PYTHON, str(DRIVER), action, str(directory), "--out", str(out)]
    command += ["--num-layers", str(LAYERS)] + [str(e) for e in extra]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(Path(out).read_text())


def _described(entries):
    """Our entries as the driver describes megatron-core's: one row per chunk."""
    tensors, objects = [], []
    for entry in entries.values():
        if isinstance(entry, dc.ShardedObject):
            objects.append(entry.unique_key)
            continue
        for chunk in entry.chunks:
            tensors.append([entry.key, list(entry.global_shape), list(chunk.global_offset)])
    return {"tensors": sorted(tensors), "objects": sorted(objects)}


def _config(state, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=state.get_tensor_model_parallel_world_size(),
        expert_model_parallel_size=state.get_expert_model_parallel_world_size(),
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def _moe_gpt(state):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
    )

    config = _config(
        state,
        num_moe_experts=EXPERTS,
        moe_router_topk=2,
        moe_ffn_hidden_size=MOE_FFN,
        moe_shared_expert_intermediate_size=SHARED_FFN,
        moe_shared_expert_gate=True,
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        add_bias_linear=False,
    )
    torch.manual_seed(99)  # not the checkpoint's weights: the load must replace every one
    return GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=False,
        pg_collection=state,
    )


def _worker_moe_at_ep2(rank, world, directory, expected, reference):
    from megatron.core.parallel_state import initialize_model_parallel

    state = initialize_model_parallel(expert_model_parallel_size=2)
    model = _moe_gpt(state)
    entries, _ = dc.model_sharded_state_dict([model])
    # The union of the two expert-parallel ranks' pieces is megatron-core's one-process layout.
    mine = _described(entries)
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    union = {
        "tensors": sorted({tuple(map(str, t)) for d in everyone for t in d["tensors"]}),
        "objects": sorted({o for d in everyone for o in d["objects"]}),
    }
    theirs = {
        "tensors": sorted({tuple(map(str, t)) for t in reference["tensors"]}),
        "objects": sorted(reference["objects"]),
    }
    assert union == theirs
    experts = {tuple(t[2][:2]) for t in mine["tensors"] if ".experts.experts." in t[0]}
    assert experts == {(layer, 2 * rank + e) for layer in range(LAYERS) for e in (0, 1)}

    dc.load_shards(
        entries,
        str(directory),
        strictness=dc.StrictHandling.RAISE_ALL,
        counts_as_unexpected=lambda key: True,
    )
    loss = _loss(model)
    assert abs(loss - expected) <= RTOL * abs(expected), (loss, expected)


def _loss(model):
    g = torch.Generator().manual_seed(7)  # the driver's batch
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    model.eval()
    with torch.no_grad():
        return model(tokens, positions, None, labels=labels).mean().item()


def _one_process_groups():
    from megatron.core.parallel_state import initialize_model_parallel

    return initialize_model_parallel()


def _same_parameter_order(model, reference, left_out=()):
    """Our ``named_parameters()`` order is megatron-core's: torch optimizers, and the torch
    format's optimizer state, pair state with parameters by it."""
    ours = [name for name, _ in model.named_parameters() if name not in left_out]
    assert ours == reference["parameters"]


def test_gpt_parameter_order_equals_megatron_cores(tmp_path):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    reference = _mcore("describe", "-", tmp_path / "gpt.json")
    model = GPTModel(
        _config(_one_process_groups()),
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=False,  # the driver's default
    )
    assert "decoder.layers.0.self_attention.linear_proj.bias" in reference["parameters"]
    _same_parameter_order(model, reference)


def test_moe_gpt_layout_equals_megatron_core_and_its_checkpoint_loads_at_ep2(tmp_path):
    reference = _mcore("describe", "-", tmp_path / "layout.json", *MOE_FLAGS)
    assert any(
        t[0] == "decoder.layers.mlp.experts.experts.linear_fc1.weight" for t in reference["tensors"]
    )
    _same_parameter_order(_moe_gpt(_one_process_groups()), reference)
    saved = _mcore("save", tmp_path / "mcore", tmp_path / "saved.json", *MOE_FLAGS)
    directory = tmp_path / "mcore" / "iter_0000001"
    run_distributed(_worker_moe_at_ep2, 2, str(directory), saved["loss"], reference)


def test_moe_gpt_checkpoint_written_here_loads_in_megatron_core(tmp_path):
    from megatron.core.dist_checkpointing.megatron_layout import unstack, with_extra_state
    from megatron.core.parallel_state import initialize_model_parallel

    state = initialize_model_parallel()
    model = _moe_gpt(state)
    # The checkpoint's values must be ours, not an initialization (the router's expert bias, a
    # buffer, too: it changes which experts the tokens go to).
    for p in list(model.parameters()) + [
        layer.mlp.router.expert_bias for layer in model.decoder.layers
    ]:
        p.data.add_(torch.randn_like(p) * 0.01)
    entries, _ = dc.model_sharded_state_dict([model])
    directory = tmp_path / "ours"
    dc.save_shards(entries, str(directory))
    dc.save_common({"iteration": 1, "checkpoint_version": 3.0}, str(directory))
    dc.write_metadata_json(str(directory))
    loaded = _mcore(
        "load", directory, tmp_path / "mc.json", "--tensors", tmp_path / "mc.pt", *MOE_FLAGS
    )
    theirs = torch.load(tmp_path / "mc.pt", weights_only=True)
    ours = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    assert sorted(theirs) == sorted(ours)
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours[name]), name
    expected = _loss(model)
    assert abs(loaded["loss"] - expected) <= RTOL * abs(expected), (loaded["loss"], expected)
    # Read back as a whole (the offline tools' view), the file holds our tensors under our names.
    shapes = dc.tensor_shapes(dc.read_dcp_metadata(str(directory)))
    whole = {k: dc.replicated(k, torch.empty(s, dtype=d)) for k, (s, d) in shapes.items()}
    dc.load_shards(whole, str(directory))
    assert sorted(unstack({k: e.data for k, e in whole.items()})) == sorted(ours)
    # The torch format: megatron-core's state_dict() has the _extra_state entries ours writes.
    other = with_extra_state(model, model.state_dict())
    assert sorted(k for k, v in other.items() if not torch.is_tensor(v)) == loaded["other_keys"]


def _one_process_layout(model):
    entries, _ = dc.model_sharded_state_dict([model])
    return _described(entries)


def _loads_in_megatron_core(model, family, tmp_path):
    """megatron-core loads ``model``'s checkpoint written here: every tensor it holds equals
    ours (read by name)."""
    for p in model.parameters():  # the checkpoint's values must be ours, not an initialization
        p.data.add_(torch.randn_like(p) * 0.01)
    entries, _ = dc.model_sharded_state_dict([model])
    directory = tmp_path / f"ours_{family}"
    dc.save_shards(entries, str(directory))
    dc.save_common({"iteration": 1, "checkpoint_version": 3.0}, str(directory))
    dc.write_metadata_json(str(directory))
    out = tmp_path / f"{family}_loaded.json"
    _mcore("load", directory, out, "--tensors", tmp_path / "t.pt", "--family", family)
    theirs = torch.load(tmp_path / "t.pt", weights_only=True)
    ours = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    if family == "t5":
        ours["position_embeddings.weight"] = ours["embedding.position_embeddings.weight"]
        ours["output_layer.bias"] = ours["lm_head.output_layer.bias"]
    assert sorted(theirs) == sorted(ours)
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours[name]), name


def test_bert_layout_equals_megatron_core_both_ways(tmp_path):
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.parallel_state import initialize_model_parallel

    reference = _mcore("describe", "-", tmp_path / "bert.json", "--family", "bert")
    state = initialize_model_parallel()
    model = BertModel(
        _config(state),
        2,
        bert_layer_local_spec,
        VOCAB,
        SEQ,
        share_embeddings_and_output_weights=True,
        pg_collection=state,
    )
    assert _one_process_layout(model) == {k: reference[k] for k in ("tensors", "objects")}
    _same_parameter_order(model, reference)
    _loads_in_megatron_core(model, "bert", tmp_path)

    # And the other way: megatron-core's BERT checkpoint loads here, every tensor equal.
    extra = ["--family", "bert", "--tensors", tmp_path / "mcore_bert.pt"]
    _mcore("save", tmp_path / "mcore_bert", tmp_path / "mb.json", *extra)
    model = BertModel(
        _config(state),
        2,
        bert_layer_local_spec,
        VOCAB,
        SEQ,
        share_embeddings_and_output_weights=True,
        pg_collection=state,
    )
    entries, _ = dc.model_sharded_state_dict([model])
    directory = tmp_path / "mcore_bert" / "iter_0000001"
    dc.load_shards(entries, str(directory), strictness=dc.StrictHandling.RAISE_ALL)
    theirs = torch.load(tmp_path / "mcore_bert.pt", weights_only=True)
    ours = model.state_dict()
    assert sorted(theirs) == sorted(ours)
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours[name]), name


def test_t5_layout_equals_megatron_core_both_ways(tmp_path):
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.parallel_state import initialize_model_parallel

    reference = _mcore("describe", "-", tmp_path / "t5.json", "--family", "t5")
    state = initialize_model_parallel()
    model = T5Model(
        _config(state),
        _config(state),
        get_t5_encoder_layer_local_spec(),
        get_t5_decoder_layer_local_spec(),
        VOCAB,
        SEQ,
        share_embeddings_and_output_weights=True,
        pg_collection=state,
    )
    ours = _one_process_layout(model)
    assert {"position_embeddings.weight", "output_layer.bias"} <= {t[0] for t in ours["tensors"]}
    # The driver builds megatron-core's T5 with the final norms it has under Transformer Engine.
    assert "encoder.final_layernorm.weight" in {t[0] for t in reference["tensors"]}
    assert ours == {k: reference[k] for k in ("tensors", "objects")}
    _same_parameter_order(model, reference)
    _loads_in_megatron_core(model, "t5", tmp_path)

    # And the other way: megatron-core's T5 checkpoint loads here (every tensor asked for, none
    # left over) and gives its loss on the same batch.
    saved = _mcore("save", tmp_path / "mcore_t5", tmp_path / "mt5.json", "--family", "t5")
    torch.manual_seed(99)  # not the checkpoint's weights: the load must replace every one
    model = T5Model(
        _config(state),
        _config(state),
        get_t5_encoder_layer_local_spec(),
        get_t5_decoder_layer_local_spec(),
        VOCAB,
        SEQ,
        share_embeddings_and_output_weights=True,
        pg_collection=state,
    )
    entries, _ = dc.model_sharded_state_dict([model])
    dc.load_shards(
        entries,
        str(tmp_path / "mcore_t5" / "iter_0000001"),
        strictness=dc.StrictHandling.RAISE_ALL,
        counts_as_unexpected=lambda key: True,
    )
    g = torch.Generator().manual_seed(7)  # the driver's t5_batch (no padding)
    encoder, decoder, labels = (torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in "edl")
    no_padding = torch.ones(2, SEQ, dtype=torch.long)
    model.eval()
    with torch.no_grad():
        loss = model(encoder, decoder, no_padding, no_padding, labels).float().mean().item()
    assert abs(loss - saved["loss"]) <= RTOL * abs(saved["loss"]), (loss, saved["loss"])


def test_moe_gpt_mixing_dense_and_moe_layers_layout_and_checkpoint(tmp_path):
    # --moe-layer-freq: megatron-core keys such a model layer by layer (no layer axis).
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.parallel_state import initialize_model_parallel

    flags = [f for f in MOE_FLAGS if f != "--moe-router-enable-expert-bias"]
    flags += ["--moe-layer-freq", "1,0"]
    reference = _mcore("describe", "-", tmp_path / "layout.json", *flags)
    assert any(t[0] == "decoder.layers.1.mlp.linear_fc1.weight" for t in reference["tensors"])
    saved = _mcore("save", tmp_path / "mcore", tmp_path / "saved.json", *flags)
    state = initialize_model_parallel()
    config = _config(
        state,
        num_moe_experts=EXPERTS,
        moe_router_topk=2,
        moe_ffn_hidden_size=MOE_FFN,
        moe_shared_expert_intermediate_size=SHARED_FFN,
        moe_shared_expert_gate=True,
        moe_layer_freq=[1, 0],
        add_bias_linear=False,
    )
    torch.manual_seed(99)
    model = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=False,  # the driver's default
        pg_collection=state,
    )
    entries, _ = dc.model_sharded_state_dict([model])
    assert _described(entries) == {
        "tensors": sorted(reference["tensors"]),
        "objects": sorted(reference["objects"]),
    }
    _same_parameter_order(model, reference)
    directory = tmp_path / "mcore" / "iter_0000001"
    dc.load_shards(entries, str(directory), strictness=dc.StrictHandling.RAISE_ALL)
    loss = _loss(model)
    assert abs(loss - saved["loss"]) <= RTOL * abs(saved["loss"]), (loss, saved["loss"])
