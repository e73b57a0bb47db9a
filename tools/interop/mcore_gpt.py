"""Drive megatron-core's own GPTModel on CPU: save or load a ``torch_dist`` checkpoint through
``megatron.core.dist_checkpointing`` and compute the loss of a fixed batch; or describe the
checkpoint layout of its GPT (dense or MoE), BERT or T5 model.

Runs in a Python environment that has megatron-core (see ``make interop``), never in this
project's: both packages are imported as ``megatron``. One process (TP=1, PP=1, local spec).

    python tools/interop/mcore_gpt.py save DIR --out result.json [model flags]
    python tools/interop/mcore_gpt.py load DIR --out result.json --tensors state.pt [model flags]
    python tools/interop/mcore_gpt.py train DIR --out result.json --iters N [--save-at K]
        [--load CKPT] [--optimizer-sharding none|dp_reshardable|fully_reshardable] [model flags]
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

``train`` trains with megatron-core's own DDP, optimizer (``get_megatron_optimizer``: Adam, clip
1.0; with ``--optimizer-sharding dp_reshardable|fully_reshardable`` its distributed optimizer)
and LR scheduler (constant), on the batch of :func:`train_batch` at each iteration. With
``--load CKPT`` it first loads model, optimizer, scheduler and iteration from the torch_dist
root CKPT as Megatron-LM does (the checkpoint's ``content_metadata`` says how the optimizer
state is sharded). It trains up to iteration ``--iters``, saving model + optimizer + scheduler +
iteration into DIR/iter_<K> (and the tracker) after iteration ``--save-at`` K, as Megatron-LM's
training loop writes them (``--ckpt-format torch``: one ``mp_rank_00/model_optim_rng.pt``, as
Megatron-LM's torch format at TP=1, PP=1, with its ``args`` (the fields a loader reads) and
``rng_state``, loaded back the same way); ``--out`` gets
``{"losses": {iteration: loss}}``.

megatron-core 0.16.1 imports without Transformer Engine or apex; its local spec runs on CPU once
``torch.cuda.current_device`` and the CUDA RNG calls are pointed at the CPU (done here, in the
driver, before megatron-core is imported); its MoE router needs ``te_general_gemm`` defined.
Its optimizers need more (tensors made with
``device="cuda"``, ``.cuda()``, type checks against ``torch.cuda.FloatTensor``): see
:func:`_optimizer_on_cpu`.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

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


def _optimizer_on_cpu() -> None:
    """megatron-core's optimizers create tensors with ``device="cuda"``, call ``.cuda()`` and
    check ``tensor.type() == "torch.cuda.FloatTensor"``: on CPU, make the first two CPU tensors
    and report CPU tensors under the CUDA type names."""
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if "cuda" in str(kwargs.get("device", "")):
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    CudaToCpu().__enter__()  # for the rest of the process
    torch.Tensor.cuda = lambda self, *a, **k: self
    cpu_type = torch.Tensor.type

    def cuda_type(self, *a, **k):
        if a or k:
            return cpu_type(self, *a, **k)
        name = cpu_type(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("save", "load", "train", "describe"))
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
    p.add_argument("--iters", type=int, help="train: the last iteration to train")
    p.add_argument("--save-at", type=int, help="train: save after this iteration")
    p.add_argument("--load", help="train: resume from this torch_dist checkpoint root first")
    p.add_argument(
        "--optimizer-sharding",
        choices=("none", "dp_reshardable", "fully_reshardable"),
        default="none",
        help="train: without the distributed optimizer, or with it in this sharding type",
    )
    p.add_argument(
        "--ckpt-format",
        choices=("torch_dist", "torch"),
        default="torch_dist",
        help="train: the format to save and load (torch: one process, no distributed optimizer)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
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


def train_batch(args, iteration: int):
    """The batch of training iteration ``iteration``: [2, seq] tokens and labels."""
    g = torch.Generator().manual_seed(1000 * args.batch_seed + iteration)
    tokens = torch.randint(0, args.vocab_size, (2, args.seq_length), generator=g)
    labels = torch.randint(0, args.vocab_size, (2, args.seq_length), generator=g)
    return tokens, labels


def _keep_adamw_step_on_fully_reshardable_load() -> None:
    """Two faults of megatron-core 0.16.1's distributed optimizer with torch's AdamW (its path
    without Transformer Engine or apex), which a fully_reshardable load hits:

    * it restores the step from the param groups into ONE tensor shared by every parameter's
      state, which AdamW then advances once per parameter at each step (a resumed run would
      use a wrong bias correction from its first step on);
    * it then copies every entry of the parameter's state from the checkpoint, "step" included,
      which that format does not hold: a KeyError.

    Give each parameter its own copy of the restored step, and keep it through the copy."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def own_step(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state and "step" not in tensors:
            state["step"] = state["step"].clone()
            tensors = {**tensors, "step": state["step"].clone()}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = own_step


def _megatron_lm_rng_state() -> dict:
    """The RNG state Megatron-LM's torch format stores per data-parallel rank (numpy's as
    ``np.random.get_state()`` returns it; the CUDA state is the CPU one here)."""
    import random

    import numpy as np

    from megatron.core import tensor_parallel

    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _megatron_lm_args(args, iteration: int, global_batch_size: int) -> argparse.Namespace:
    """The part of Megatron-LM's saved ``args`` a loader reads: the model's shape, the
    optimizer layout and the samples consumed so far (Megatron-LM saves its whole Namespace)."""
    return argparse.Namespace(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        padded_vocab_size=args.vocab_size,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        use_distributed_optimizer=False,
        params_dtype=torch.float32,
        iteration=iteration,
        consumed_train_samples=iteration * global_batch_size,
        consumed_valid_samples=0,
    )


def _train(model, config, args) -> dict:
    """Megatron-LM's resume and training loop for one process (see the module docstring)."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    _optimizer_on_cpu()
    distributed = args.optimizer_sharding != "none"
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, grad_reduce_in_fp32=True
        ),
        model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            weight_decay=args.weight_decay,
            clip_grad=1.0,
            use_distributed_optimizer=distributed,
        ),
        [ddp],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr,
        max_lr=args.lr,
        min_lr=args.lr,
        lr_warmup_steps=0,
        lr_decay_steps=1000,
        lr_decay_style="constant",
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=1000,
        wd_incr_style="constant",
    )
    # Megatron-LM's content metadata (how the optimizer state is sharded).
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if distributed:
        metadata["distrib_optim_sharding_type"] = args.optimizer_sharding

    iteration = 0
    if args.load and args.ckpt_format == "torch":
        # Megatron-LM's torch format at TP=1, PP=1: mp_rank_00/model_optim_rng.pt.
        with open(os.path.join(args.load, "latest_checkpointed_iteration.txt")) as f:
            directory = os.path.join(args.load, f"iter_{int(f.read().strip()):07d}")
        saved = torch.load(
            os.path.join(directory, "mp_rank_00", "model_optim_rng.pt"), weights_only=False
        )
        model.load_state_dict(saved["model"], strict=True)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["opt_param_scheduler"])
        iteration = int(saved["iteration"])
    elif args.load:
        with open(os.path.join(args.load, "latest_checkpointed_iteration.txt")) as f:
            directory = os.path.join(args.load, f"iter_{int(f.read().strip()):07d}")
        common = dist_checkpointing.load_common_state_dict(directory)
        saved_metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
        if distributed:
            # With torch's AdamW (no Transformer Engine or apex) megatron-core's distributed
            # optimizer cannot describe its state before it has any; it fills it with dummy
            # values first (as it does for its FSDP loads), which the load then overwrites.
            for inner in optimizer.chained_optimizers:
                inner._init_optimizer_states_with_dummy_values()
            _keep_adamw_step_on_fully_reshardable_load()
        model_state = model.sharded_state_dict()
        state = {
            "model": model_state,
            "optimizer": optimizer.sharded_state_dict(
                model_state, is_loading=True, metadata=saved_metadata
            ),
        }
        state = dist_checkpointing.load(state, directory)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(common["opt_param_scheduler"])
        iteration = int(common["iteration"])

    positions = torch.arange(args.seq_length).unsqueeze(0).expand(2 // dist.get_world_size(), -1)
    causal = torch.triu(torch.ones(args.seq_length, args.seq_length, dtype=torch.bool), 1)
    losses = {}
    while iteration < args.iters:
        iteration += 1
        model.train()
        tokens, labels = train_batch(args, iteration)
        # Data parallel: each rank trains on its equal share of the batch (DDP averages the
        # gradients), and the loss of the batch is the average of the shares' losses.
        share = tokens.shape[0] // dist.get_world_size()
        mine = slice(dist.get_rank() * share, (dist.get_rank() + 1) * share)
        tokens, labels = tokens[mine], labels[mine]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(tokens, positions, causal.view(1, 1, *causal.shape), labels=labels)
        loss = loss.float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        applied, _grad_norm, _zeros = optimizer.step()
        assert applied, f"iteration {iteration}: the optimizer skipped its step"
        scheduler.step(increment=share * dist.get_world_size())
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses[iteration] = reported.item() / dist.get_world_size()
        if iteration == args.save_at and args.ckpt_format == "torch":
            directory = os.path.join(args.directory, f"iter_{iteration:07d}", "mp_rank_00")
            os.makedirs(directory, exist_ok=True)
            state = {
                "args": _megatron_lm_args(args, iteration, share * dist.get_world_size()),
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "opt_param_scheduler": scheduler.state_dict(),
                "iteration": iteration,
                "checkpoint_version": 3.0,
                "num_floating_point_operations_so_far": 0.0,
                "rng_state": [_megatron_lm_rng_state()],
            }
            torch.save(state, os.path.join(directory, "model_optim_rng.pt"))
            with open(os.path.join(args.directory, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
        elif iteration == args.save_at:
            directory = os.path.join(args.directory, f"iter_{iteration:07d}")
            os.makedirs(directory, exist_ok=True)
            model_state = model.sharded_state_dict()
            state = {
                "model": model_state,
                "optimizer": optimizer.sharded_state_dict(model_state, metadata=metadata),
                "opt_param_scheduler": scheduler.state_dict(),
                "iteration": iteration,
                "checkpoint_version": 3.0,
                "num_floating_point_operations_so_far": 0.0,
            }
            dist_checkpointing.save(state, directory, content_metadata=metadata)
            with open(os.path.join(args.directory, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
    return {"losses": losses}


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

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = None
    if "WORLD_SIZE" in os.environ:  # started by torchrun (train only): data parallel
        if args.action != "train":
            print("error: only `train` runs with more than one process", file=sys.stderr)
            return 2
        dist.init_process_group("gloo")
    else:
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
            layout = describe(model.sharded_state_dict())
            # The order torch optimizers (and the torch format) pair state with parameters by.
            layout["parameters"] = [name for name, _ in model.named_parameters()]
            json.dump(layout, f)
        dist.destroy_process_group()
        os.remove(store)
        return 0
    if args.action == "train":
        result = _train(model, model.config, args)
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
        dist.destroy_process_group()
        if store is not None:
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
