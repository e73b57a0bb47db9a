"""Drive megatron-core's own GPTModel on CPU: save or load a ``torch_dist`` checkpoint through
``megatron.core.dist_checkpointing`` and compute the loss of a fixed batch; or describe the
checkpoint layout of its GPT (dense or MoE), BERT or T5 model.

Runs in a Python environment that has megatron-core (see ``make interop``), never in this
project's: both packages are imported as ``megatron``. One process (TP=1, PP=1, local spec).

    python tools/interop/mcore_gpt.py save DIR --out result.json [model flags]
    python tools/interop/mcore_gpt.py load DIR --out result.json --tensors state.pt [model flags]
    python tools/interop/mcore_gpt.py describe - --out layout.json --family bert [model flags]

``save`` builds the model from ``--seed`` and writes it into DIR/iter_0000001 (with the tracker
file, as Megatron-LM lays it out); ``load`` reads the torch_dist directory DIR into a model built
from another seed. Both write ``{"loss": ..., "keys": [...], "other_keys": [...]}`` (the
tensor and the other entries of the model's state_dict) to ``--out``; ``load`` also writes the
loaded model's state dict (per-layer names) to ``--tensors``. ``--torch-save D`` (save) also
writes the torch format, ``D/iter_0000001/mp_rank_00/model_optim_rng.pt``; ``--torch-load FILE``
(load) also loads a torch-format file strictly into another model (``"torch_loss"``).
For BERT and T5 (``--family``), ``save`` and ``load`` compute no loss (``"loss": null``).
``describe`` writes the keys, global shapes and offsets of ``model.sharded_state_dict()``'s
tensors and the unique keys of its objects (see :func:`describe`). ``--num-experts N`` makes
the GPT a MoE model (every layer, top-2, SequentialMLP experts).

megatron-core 0.16.1 imports without Transformer Engine or apex; its local spec runs on CPU once
``torch.cuda.current_device`` and the CUDA RNG calls are pointed at the CPU (done here, in the
driver, before megatron-core is imported); its MoE router needs ``te_general_gemm`` defined.
"""

import argparse
import json
import os
import sys

import torch

ITERATION = 1  # of the checkpoint that ``save`` writes


def _cuda_calls_on_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None
    import megatron.core.tensor_parallel.random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # The router's gating GEMM names Transformer Engine's GEMM, left undefined without TE.
    import megatron.core.transformer.moe.moe_utils as moe_utils

    moe_utils.te_general_gemm = None


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("save", "load", "describe"))
    p.add_argument("directory")
    p.add_argument("--out", required=True)
    p.add_argument("--tensors")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=16)
    p.add_argument("--max-position-embeddings", type=int, default=None)
    p.add_argument("--tied", action="store_true", help="share embedding and output weights")
    p.add_argument("--batch-seed", type=int, default=7)
    p.add_argument("--num-experts", type=int, default=None, help="GPT: MoE layers, top-2")
    p.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    p.add_argument("--disable-bias-linear", action="store_true")
    p.add_argument("--moe-shared-expert-gate", action="store_true")
    p.add_argument(
        "--moe-layer-freq",
        type=lambda text: [int(v) for v in text.split(",")],
        default=None,
        help="comma-separated 0/1 per layer: which layers are MoE (the others dense)",
    )
    p.add_argument(
        "--moe-router-enable-expert-bias",
        action="store_true",
        help="with the sigmoid score function, as megatron-core requires",
    )
    p.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    p.add_argument(
        "--family",
        choices=("gpt", "bert", "t5"),
        default="gpt",
        help="describe: the model whose sharded_state_dict() is described",
    )
    p.add_argument(
        "--torch-save", help="save: also write DIR/iter_0000001/mp_rank_00/model_optim_rng.pt"
    )
    p.add_argument(
        "--torch-load", help="load: also load this torch-format file (strictly) into another model"
    )
    return p.parse_args(argv)


def batch(args):
    """The batch both code bases compute the loss of: [2, seq] tokens and labels."""
    g = torch.Generator().manual_seed(args.batch_seed)
    tokens = torch.randint(0, args.vocab_size, (2, args.seq_length), generator=g)
    labels = torch.randint(0, args.vocab_size, (2, args.seq_length), generator=g)
    return tokens, labels


def loss_of(model, args) -> float:
    """The mean per-token loss of ``batch(args)``."""
    model.eval()
    tokens, labels = batch(args)
    positions = torch.arange(args.seq_length).unsqueeze(0).expand_as(tokens)
    causal = torch.triu(torch.ones(args.seq_length, args.seq_length, dtype=torch.bool), 1)
    with torch.no_grad():
        losses = model(tokens, positions, causal.view(1, 1, *causal.shape), labels=labels)
    return losses.float().mean().item()


def build_model(args):
    """megatron-core's model of ``args.family`` with its local spec, fp32 on the CPU; a GPT with
    ``--num-experts`` has MoE layers (top-2, dropless, allgather dispatcher: the alltoall one
    makes a CUDA stream)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if args.num_experts:
        moe = dict(
            num_moe_experts=args.num_experts,
            moe_router_topk=2,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_token_dispatcher_type="allgather",
            moe_shared_expert_gate=args.moe_shared_expert_gate,
        )
        if args.moe_layer_freq:
            moe["moe_layer_freq"] = args.moe_layer_freq
        if args.moe_router_enable_expert_bias:
            moe.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=not args.disable_bias_linear,
        **moe,
    )
    positions = args.max_position_embeddings or args.seq_length
    if args.family == "bert":
        from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
        from megatron.core.models.bert.bert_model import BertModel

        return BertModel(
            config,
            num_tokentypes=2,
            transformer_layer_spec=bert_layer_local_spec,
            vocab_size=args.vocab_size,
            max_sequence_length=positions,
            share_embeddings_and_output_weights=True,  # as pretrain_bert.py builds it
        )
    if args.family == "t5":
        from megatron.core.models.T5 import T5Model
        from megatron.core.models.T5.t5_spec import (
            get_t5_decoder_with_local_block_spec,
            get_t5_encoder_with_local_block_spec,
        )

        return T5Model(
            config,
            config,
            get_t5_encoder_with_local_block_spec(args.num_layers),
            get_t5_decoder_with_local_block_spec(args.num_layers),
            vocab_size=args.vocab_size,
            max_sequence_length=positions,
            share_embeddings_and_output_weights=True,  # as pretrain_t5.py builds it
        )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if args.moe_layer_freq:  # dense and MoE layers: one local spec per layer
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    else:
        spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    return GPTModel(
        config,
        spec,
        vocab_size=args.vocab_size,
        max_sequence_length=positions,
        share_embeddings_and_output_weights=args.tied,
    )


def describe(sharded) -> dict:
    """The checkpoint layout of a sharded state dict: each tensor's key, global shape and
    global offset (of this rank's piece, prepended axes included), each object's unique key."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    tensors, objects = [], []
    for entry in sharded.values():
        if isinstance(entry, ShardedTensor):
            tensors.append([entry.key, list(entry.global_shape), list(entry.global_offset)])
        elif isinstance(entry, ShardedObject):
            objects.append(entry.unique_key)
        else:
            raise TypeError(f"{type(entry).__name__} in the sharded state dict")
    return {"tensors": sorted(tensors), "objects": sorted(objects)}


def main(argv=None) -> int:
    args = parse(argv)
    try:
        from megatron.core import package_info
    except ImportError:
        print(
            "error: `megatron.core` here is not megatron-core (run with the Python of an "
            "environment that has it, without this repository on PYTHONPATH)",
            file=sys.stderr,
        )
        return 2
    print(f"megatron-core {package_info.__version__}")
    _cuda_calls_on_cpu()
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = os.path.join(os.path.dirname(os.path.abspath(args.out)), ".mcore_store")
    if os.path.exists(store):
        os.remove(store)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed if args.action == "save" else args.seed + 1)
    model = build_model(args)
    if args.action == "describe":
        with open(args.out, "w") as f:
            json.dump(describe(model.sharded_state_dict()), f)
        dist.destroy_process_group()
        os.remove(store)
        return 0
    # As Megatron-LM's training loop does: the model's sharded state under "model", the
    # non-tensor state (iteration, ...) beside it in common.pt.
    if args.action == "save":
        # Megatron-LM's directory: DIR/iter_0000001 and the tracker naming it.
        directory = os.path.join(args.directory, f"iter_{ITERATION:07d}")
        os.makedirs(directory, exist_ok=True)
        state = {
            "model": model.sharded_state_dict(),
            "iteration": ITERATION,
            "checkpoint_version": 3.0,
        }
        dist_checkpointing.save(state, directory)
        with open(os.path.join(args.directory, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    else:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, args.directory)
        model.load_state_dict(loaded["model"])
    if args.action == "save" and args.torch_save:
        # Megatron-LM's torch format at TP=1, PP=1 (the model part and the iteration).
        directory = os.path.join(args.torch_save, f"iter_{ITERATION:07d}", "mp_rank_00")
        os.makedirs(directory, exist_ok=True)
        state = {"model": model.state_dict(), "iteration": ITERATION, "checkpoint_version": 3.0}
        torch.save(state, os.path.join(directory, "model_optim_rng.pt"))
        with open(os.path.join(args.torch_save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    full = model.state_dict()
    state = {k: v for k, v in full.items() if torch.is_tensor(v)}
    result = {
        "loss": loss_of(model, args) if args.family == "gpt" else None,  # GPT's forward
        "keys": sorted(state),
        "other_keys": sorted(k for k in full if k not in state),  # _extra_state entries
    }
    if args.action == "load" and args.torch_load:
        other = build_model(args)
        saved = torch.load(args.torch_load, map_location="cpu", weights_only=False)
        other.load_state_dict(saved["model"], strict=True)  # as Megatron-LM loads it
        result["torch_loss"] = loss_of(other, args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    if args.tensors:
        torch.save(state, args.tensors)
    dist.destroy_process_group()
    os.remove(store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
