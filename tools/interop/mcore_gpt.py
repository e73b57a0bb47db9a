"""Drive megatron-core's own GPTModel on CPU: save or load a ``torch_dist`` checkpoint through
``megatron.core.dist_checkpointing`` and compute the loss of a fixed batch; or describe the
checkpoint layout of its GPT (dense or MoE), BERT or T5 model.

Runs in a Python environment that has megatron-core (see ``make interop``), never in this
project's: both packages are imported as ``megatron``. One process (TP=1, PP=1, local spec);
under torchrun, ``train`` runs data parallel and ``describe`` / ``save`` at
``--tensor-model-parallel-size`` (one process per TP rank; rank 0 writes ``--out``).

    python tools/interop/mcore_gpt.py save DIR --out result.json [model flags]
    python tools/interop/mcore_gpt.py load DIR --out result.json --tensors state.pt [model flags]
    python tools/interop/mcore_gpt.py train DIR --out result.json --iters N [--save-at K]
        [--load CKPT] [--optimizer-sharding none|dp_reshardable|fully_reshardable] [model flags]
    python tools/interop/mcore_gpt.py describe - --out layout.json --family bert [model flags]
    python tools/interop/mcore_gpt.py rng DIR --out draws.json --rng-grid PP,TP
    python tools/interop/mcore_gpt.py rerun DIR --out machine.json

``save`` builds the model from ``--seed`` and writes it into DIR/iter_0000001 (with the tracker
file, as Megatron-LM lays it out); ``load`` reads the torch_dist directory DIR into a model built
from another seed. Both write ``{"loss": ..., "keys": [...], "other_keys": [...]}`` (the
tensor and the other entries of the model's state_dict) to ``--out``; ``load`` also writes the
loaded model's state dict (per-layer names) to ``--tensors``. ``--torch-save D`` (save) also
writes the torch format, ``D/iter_0000001/mp_rank_00/model_optim_rng.pt``; ``--torch-load FILE``
(load) also loads a torch-format file strictly into another model (``"torch_loss"``).
For BERT and T5 (``--family``) the loss is :func:`bert_loss_of` / :func:`t5_loss_of`; the T5 is
built with its blocks' final norms (see :func:`build_model`).
``save --rng-draws FILE`` also writes the RNG state as Megatron-LM's training loop builds it for
``torch_dist`` (``get_rng_state``: the ShardedObject ``rng_state`` on the (PP, TP) = (1, 1) grid
holding a list of one dict), after advancing every stream past its seed, and then writes the
next draws of each stream (:func:`rng_draws`) to FILE. ``rng`` reads every ``rng_state`` object
of the (PP, TP) grid ``--rng-grid`` from the torch_dist directory DIR, restores each as
Megatron-LM's ``load_checkpoint`` does (:func:`restore_rng_like_megatron_lm`) and writes
``{"<pp>.<tp>": {"fields": [...], "draws": ...}}`` to ``--out``.
``save --rerun-state`` also saves the rerun state machine's state as Megatron-LM's training loop
does when the machine asks for a checkpoint (after a reproduced fault: see
:func:`_machine_at_a_rerun_checkpoint`); ``rerun`` loads a machine's state from the torch_dist
directory DIR as Megatron-LM's ``load_checkpoint`` does and writes its fields
(:func:`machine_fields`) to ``--out``.
``describe`` writes the keys, global shapes and offsets of ``model.sharded_state_dict()``'s
tensors and the unique keys of its objects (see :func:`describe`; at TP>1 one such description
per rank: ``{"ranks": [...]}``). ``--num-experts N`` makes
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
``{"losses": {iteration: loss}}``. With ``--bf16`` the model is bf16 in megatron-core's
``Float16Module`` and the optimizer its mixed-precision one (fp32 main weights), as Megatron-LM
builds them for ``--bf16``.

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
import random
import sys

import numpy as np
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
    p.add_argument("action", choices=("save", "load", "train", "describe", "rng", "rerun"))
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
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="describe, save: the TP size (start the driver with torchrun, one process per rank)",
    )
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
        "--describe-to",
        help="save: also write what `describe` writes, to this file (one start for both)",
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
    p.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="train: megatron-core's DDP with --overlap-grad-reduce and this bucket size",
    )
    p.add_argument("--rng-draws", help="save: also save the RNG state; write its next draws here")
    p.add_argument(
        "--rng-grid",
        type=lambda text: tuple(int(v) for v in text.split(",")),
        help="rng: the (PP, TP) grid of the rng_state objects to read, e.g. 1,2",
    )
    p.add_argument(
        "--rerun-state", action="store_true", help="save: also save a rerun state machine's state"
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="train: bf16 model (Float16Module) and megatron-core's mixed-precision optimizer",
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


def bert_batch(args):
    """The BERT batch both code bases compute the loss of: [2, seq] tokens, token types (two
    segments), padding mask (the second sample's last 3 positions are padding), masked-LM
    labels, and the sentence-order labels [2]."""
    g = torch.Generator().manual_seed(args.batch_seed)
    tokens = torch.randint(0, args.vocab_size, (2, args.seq_length), generator=g)
    labels = torch.randint(0, args.vocab_size, (2, args.seq_length), generator=g)
    types = (torch.arange(args.seq_length) >= args.seq_length // 2).long().expand(2, -1)
    padding = torch.ones(2, args.seq_length, dtype=torch.long)
    padding[1, -3:] = 0
    return tokens, types.contiguous(), padding, labels, torch.tensor([0, 1])


def bert_loss_of(model, args) -> float:
    """The masked-LM loss of :func:`bert_batch` averaged over its real (not padding) tokens,
    plus the sentence-order loss of its binary head."""
    model.eval()
    tokens, types, padding, labels, order = bert_batch(args)
    with torch.no_grad():
        lm, binary = model(tokens, padding, tokentype_ids=types, lm_labels=labels)
    lm = (lm.float() * padding).sum() / padding.sum()
    return (lm + torch.nn.functional.cross_entropy(binary.float(), order)).item()


def t5_batch(args):
    """The T5 batch both code bases compute the loss of: [2, seq] encoder tokens, decoder tokens
    and labels (no padding)."""
    g = torch.Generator().manual_seed(args.batch_seed)
    return tuple(
        torch.randint(0, args.vocab_size, (2, args.seq_length), generator=g) for _ in "edl"
    )


def t5_loss_of(model, args) -> float:
    """The mean per-token loss of :func:`t5_batch`. megatron-core's masks (True = masked): none
    in the encoder and from the decoder to the encoder, causal in the decoder."""
    model.eval()
    encoder, decoder, labels = t5_batch(args)
    visible = torch.zeros(2, 1, args.seq_length, args.seq_length, dtype=torch.bool)
    causal = torch.triu(torch.ones(args.seq_length, args.seq_length, dtype=torch.bool), 1)
    with torch.no_grad():
        losses = model(encoder, decoder, visible, causal.expand(2, 1, -1, -1), visible, labels)
    return losses.float().mean().item()


def train_batch(args, iteration: int):
    """The batch of training iteration ``iteration``: [2, seq] tokens and labels."""
    g = torch.Generator().manual_seed(1000 * args.batch_seed + iteration)
    tokens = torch.randint(0, args.vocab_size, (2, args.seq_length), generator=g)
    labels = torch.randint(0, args.vocab_size, (2, args.seq_length), generator=g)
    return tokens, labels


def _keep_adamw_step_on_distributed_load() -> None:
    """Faults of megatron-core 0.16.1's distributed optimizer with torch's AdamW (its path
    without Transformer Engine or apex), which its loads hit:

    * it restores the step from the param groups into ONE tensor shared by every parameter's
      state, which AdamW then advances once per parameter at each step (a resumed run would
      use a wrong bias correction from its first step on);
    * it then copies every entry of the parameter's state from the checkpoint, "step" included,
      which fully_reshardable does not hold (a KeyError) and dp_reshardable takes from the
      state before the load;
    * dp_reshardable copies into fp32 main params that are views of leaf parameters outside
      ``torch.no_grad``, which autograd refuses.

    Give each parameter its own copy of the restored step, keep it through the copy, and copy
    without autograd."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def own_step(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state:
            # The step restored from the param groups; dp_reshardable hands over the step of
            # the state before the load (its "step" is not saved), which would overwrite it.
            state["step"] = state["step"].clone()
            tensors = {**tensors, "step": state["step"].clone()}
        # dp_reshardable's load copies into the fp32 main params outside no_grad: with fp32
        # weights those are views of the model's leaf parameters, which autograd refuses.
        with torch.no_grad():
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
    if args.bf16:  # as Megatron-LM's get_model wraps it: bf16 weights, fp32 outputs
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            use_distributed_optimizer=distributed,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=args.ddp_bucket_size is not None,
            bucket_size=args.ddp_bucket_size,
        ),
        model,
    )
    buffers = buffer_layouts(ddp)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            weight_decay=args.weight_decay,
            clip_grad=1.0,
            use_distributed_optimizer=distributed,
            bf16=args.bf16,
            params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
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
            _keep_adamw_step_on_distributed_load()
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
    return {"losses": losses, "buffers": buffers}


def buffer_layouts(ddp) -> list:
    """megatron-core's grad-buffer layout of each of its DDP's buffers: per bucket its
    ``numel``, ``numel_unpadded`` and its params as [name, start in the bucket, numel], in
    buffer order."""
    names = {param: name for name, param in ddp.module.named_parameters()}
    out = []
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        buckets = []
        for index, bucket in enumerate(buffer.buckets):
            params = [
                [names[param], start - bucket.offset, end - start]
                for param, (start, end, bucket_id) in buffer.param_index_map.items()
                if bucket_id == index
            ]
            buckets.append(
                {
                    "numel": bucket.grad_data.numel(),
                    "numel_unpadded": bucket.numel_unpadded,
                    "params": params,
                }
            )
        out.append(
            {"dtypes": [str(buffer.param_dtype), str(buffer.grad_dtype)], "buckets": buckets}
        )
    return out


def rng_draws() -> dict:
    """The next numbers of the four streams a checkpoint's RNG state restores."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        tracked = torch.rand(3).tolist()
    return {
        "random": random.random(),
        "numpy": float(np.random.random()),
        "torch": torch.rand(3).tolist(),
        "tracker": tracked,
    }


def megatron_lm_rng_state():
    """Megatron-LM's ``get_rng_state`` for ``torch_dist`` in one process (TP=PP=DP=1, no
    data-parallel random init): its per-rank dict in a list, as a ShardedObject over (pp, tp)."""
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),  # the CPU generator's here, see above
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject("rng_state", [state], (1, 1), (0, 0), replica_id=0)


def restore_rng_like_megatron_lm(saved: list) -> None:
    """Megatron-LM's ``load_checkpoint``, RNG part, without data-parallel random init (entry 0).
    A checkpoint written without CUDA has no ``cuda_rng_state``; Megatron-LM on a GPU stops
    there and asks for ``--no-load-rng``; on CPU there is no CUDA generator to set: skipped."""
    from megatron.core import tensor_parallel

    state = saved[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if not state["rng_tracker_states"]:
        raise KeyError("rng_tracker_states is empty")  # Megatron-LM's own check
    tensor_parallel.get_cuda_rng_tracker().set_states(
        {
            name: tensor_parallel.convert_cuda_rng_state(value, to_graphable=False)
            for name, value in state["rng_tracker_states"].items()
        }
    )


def _read_rng_grid(args) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp_size, tp_size = args.rng_grid
    requests = {
        f"{pp}.{tp}": ShardedObject("rng_state", None, (pp_size, tp_size), (pp, tp))
        for pp in range(pp_size)
        for tp in range(tp_size)
    }
    loaded = dist_checkpointing.load(dict(requests), args.directory)
    result = {}
    for place in requests:  # (the loaded dict also holds common.pt's entries)
        saved = loaded[place]
        restore_rng_like_megatron_lm(saved)
        result[place] = {"fields": sorted(saved[0]), "entries": len(saved), "draws": rng_draws()}
    return result


def _machine_at_a_rerun_checkpoint():
    """megatron-core's rerun state machine as it stands when it asks for a checkpoint: a fault
    reproduced in place at iteration 1 on rank 0, to be re-run on other hardware."""
    from megatron.core import rerun_state_machine as rsm

    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.VALIDATE_RESULTS)
    machine = rsm.get_rerun_state_machine()
    machine.state = rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT
    machine.current_iteration = 1
    machine.checkpoint_requested = True
    machine.failed_validation_call = rsm.Call(rsm.Caller("loss is NaN", 0), 2)
    machine.initial_result = 1.5
    machine.suspicious_node = "node-a"
    machine.suspicious_device = 3
    machine.large_value_counts = {"loss": 4}
    machine.max_values = {"loss": 2.5}
    machine.error_injector.error_injection_type = rsm.RerunDiagnostic.PERSISTENT_ERROR
    return machine


def machine_fields(machine) -> dict:
    """What a restarted job takes from a rerun checkpoint, as JSON values."""
    failed = machine.failed_validation_call
    return {
        "mode": machine.mode.value,
        "state": machine.state.name,
        "current_iteration": machine.current_iteration,
        "checkpoint_requested": machine.checkpoint_requested,
        "rerun_requested": machine.rerun_requested,
        "failed_validation_call": (
            None
            if failed is None
            else [type(failed).__name__, failed.caller.message, failed.caller.rank, failed.sequence]
        ),
        "initial_result": machine.initial_result,
        "suspicious_node": machine.suspicious_node,
        "suspicious_device": machine.suspicious_device,
        "large_value_counts": machine.large_value_counts,
        "max_values": machine.max_values,
        "error_injection_type": machine.error_injector.error_injection_type.value,
    }


def _load_rerun_state(args) -> dict:
    """Megatron-LM's ``load_checkpoint``, rerun part (same world size, TP, PP and DP)."""
    from megatron.core import dist_checkpointing
    from megatron.core import rerun_state_machine as rsm

    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.VALIDATE_RESULTS)
    machine = rsm.get_rerun_state_machine()
    common = dist_checkpointing.load_common_state_dict(args.directory)
    if not machine.validate_state_dict(common["rerun_state_machine"]):
        raise RuntimeError("the checkpoint's rerun_state_machine does not ask for a re-run")
    request = {
        "rerun_state_machine": machine.state_dict(
            data_iterator=None, ckpt_format="torch_dist", force=True
        )
    }
    loaded = dist_checkpointing.load(request, args.directory)
    machine.load_state_dict(loaded["rerun_state_machine"])
    return machine_fields(machine)


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
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        bf16=getattr(args, "bf16", False),
        params_dtype=torch.bfloat16 if getattr(args, "bf16", False) else torch.float32,
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
            LNImpl,
            decoder_model_with_local_spec,
            encoder_model_with_local_spec,
        )
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        # Its local block specs (get_t5_{en,de}coder_with_local_block_spec) take each block's
        # final norm from Transformer Engine (TENorm), which is None without it: no final norms
        # on CPU, while Megatron-LM's T5 (TE installed) has them. The same blocks with the
        # layers' own LayerNorm there: the same parameters, final_layernorm.{weight,bias}.
        def block(layer):
            return TransformerBlockSubmodules([layer] * args.num_layers, layer_norm=LNImpl)

        return T5Model(
            config,
            config,
            block(encoder_model_with_local_spec()),
            block(decoder_model_with_local_spec()),
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
    if "WORLD_SIZE" in os.environ:  # started by torchrun: data parallel (train) or TP
        if args.action == "load":
            print("error: `load` runs in one process", file=sys.stderr)
            return 2
        dist.init_process_group("gloo")
    else:
        store = os.path.join(os.path.dirname(os.path.abspath(args.out)), ".mcore_store")
        if os.path.exists(store):
            os.remove(store)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, 1)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed if args.action == "save" else args.seed + 1)
    if args.action in ("rng", "rerun"):
        with open(args.out, "w") as f:
            json.dump(_read_rng_grid(args) if args.action == "rng" else _load_rerun_state(args), f)
        dist.destroy_process_group()
        os.remove(store)
        return 0
    model = build_model(args)
    if args.action == "describe" or args.describe_to:
        layout = describe(model.sharded_state_dict())
        # The order torch optimizers (and the torch format) pair state with parameters by.
        layout["parameters"] = [name for name, _ in model.named_parameters()]
        if dist.get_world_size() > 1:  # one description per rank, in rank order
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, layout)
            layout = {"ranks": everyone}
        if dist.get_rank() == 0:
            with open(args.describe_to or args.out, "w") as f:
                json.dump(layout, f)
    if args.action == "describe":
        dist.destroy_process_group()
        if store is not None:
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
        if args.rng_draws:
            # Every stream away from its seed first, so that a restore from the seed fails.
            random.random(), np.random.random(), torch.rand(5)
            rng_draws()
            state["rng_state"] = megatron_lm_rng_state()
        if args.rerun_state:
            machine = _machine_at_a_rerun_checkpoint()
            state["rerun_state_machine"] = machine.state_dict(None, ckpt_format="torch_dist")
        dist_checkpointing.save(state, directory)
        if args.rng_draws:
            with open(args.rng_draws, "w") as f:
                json.dump(rng_draws(), f)
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
        "loss": {"gpt": loss_of, "bert": bert_loss_of, "t5": t5_loss_of}[args.family](model, args),
        "keys": sorted(state),
        "other_keys": sorted(k for k in full if k not in state),  # _extra_state entries
    }
    if args.action == "save" and args.rerun_state:
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        result["rerun"] = machine_fields(get_rerun_state_machine())
    if args.action == "load" and args.torch_load:
        other = build_model(args)
        saved = torch.load(args.torch_load, map_location="cpu", weights_only=False)
        other.load_state_dict(saved["model"], strict=True)  # as Megatron-LM loads it
        result["torch_loss"] = loss_of(other, args)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    if args.tensors:
        torch.save(state, args.tensors)
    dist.destroy_process_group()
    if store is not None:
        os.remove(store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
