"""Base class of language models: per-token loss and the tied embedding / output weight."""

import dataclasses
from typing import List, Sequence, Tuple

import torch

from megatron.core.device import collective_device, compute_device
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.model_state import model_sharded_state_dict
from megatron.core.tensor_parallel.collectives import group_size
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.process_groups import (
    ProcessGroupCollection,
    resolve_pg_collection,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock


class _CrossEntropy(torch.autograd.Function):
    """Per-row cross entropy that keeps one [N, V] tensor (the log-probabilities) for backward
    and turns it into the gradient in place: softmax - onehot, scaled by the incoming grad.

    About 3x faster on CPU than F.cross_entropy(reduction='none') (whose backward builds a
    one-hot grad and runs log_softmax_backward), with the same values. A second backward through
    the same graph fails loudly (autograd's in-place version check) instead of being wrong.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(logits, dim=-1)
        loss = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1).neg_()
        ctx.save_for_backward(log_probs, target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        log_probs, target = ctx.saved_tensors
        grad = log_probs.exp_()
        minus_one = torch.full((grad.shape[0], 1), -1.0, dtype=grad.dtype, device=grad.device)
        grad.scatter_add_(-1, target.unsqueeze(-1), minus_one)
        grad.mul_(grad_loss.unsqueeze(-1).to(grad.dtype))
        return grad, None


def language_model_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of ``logits`` [..., V] against ``labels`` [...]; returns [...] in the
    logits' dtype."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not match "
            f"logits of shape {tuple(logits.shape)}"
        )
    vocab = logits.shape[-1]
    flat = _CrossEntropy.apply(logits.reshape(-1, vocab), labels.reshape(-1))
    return flat.view(labels.shape)


def adopt_group_sizes(config, pg_collection):
    """(config, ProcessGroupCollection) for a model given ``pg_collection``.

    megatron-core's models read the tensor- and context-parallel sizes from their process groups,
    so code written against it leaves the config's sizes at their default of 1 (its quickstart
    builds ``TransformerConfig(num_layers=2, ...)`` at TP=2). Such a config is copied with the
    groups' sizes (the caller's object is not changed); a size the config does set must equal its
    group's (:func:`resolve_pg_collection` raises otherwise). ``pg_collection`` None means the
    groups of the current ``parallel_state`` (none: every dimension unsplit), as megatron-core's
    models fall back to ``ProcessGroupCollection.use_mpu_process_groups()``."""
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    pgs = resolve_pg_collection(None, pg_collection)
    sizes = {}
    if config.tensor_model_parallel_size == 1 and pgs.tp_size > 1:
        sizes["tensor_model_parallel_size"] = pgs.tp_size
    if config.context_parallel_size == 1 and pgs.cp_size > 1:
        sizes["context_parallel_size"] = pgs.cp_size
    if sizes:
        config = dataclasses.replace(config, **sizes)
    return config, resolve_pg_collection(config, pgs)


class LanguageModule(MegatronModule):
    """Shared pieces of GPT-like models (subclasses set ``embedding`` / ``output_layer``)."""

    # What a model class says about its own checkpoint and sharding, read by the shared code
    # without naming the class (a model family adds its class and edits no table).
    TOP_LEVEL_EXTRA_STATE: Tuple[str, ...] = ()
    """Modules outside the layers for which megatron-core writes an ``_extra_state`` object
    (grid ``(1,)``), written when the model has a tensor of the module (or of its alias); read
    by ``dist_checkpointing.model_state``. megatron-core's GPTModel writes none."""
    CHECKPOINT_ALIASES: Tuple[Tuple[str, str], ...] = ()
    """(Megatron's second key, our key) of tensors megatron-core's model registers twice: written
    under both keys, the alias read only where present (``dist_checkpointing.model_state``)."""
    TP_REPLICATED_PREFIXES: Tuple[str, ...] = ()
    """Prefixes of the modules outside the layers built from plain (not tensor-parallel) layers:
    whole on every tensor-parallel rank (the converters' split rules,
    ``megatron.checkpointing.tp_shards``)."""
    LEGACY_CHILD_ORDER: Tuple[str, ...] = ()
    """Children this code base registered in another relative order before it followed
    megatron-core's (``optimizer.param_order``): their old order."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron-core's ``sharded_state_dict``: this model's state dict keys (with ``prefix``)
        mapped to ShardedTensors in Megatron's torch_dist layout (the layers of a block stacked,
        tensor-parallel weights as this rank's shards of the global tensors), plus the layers'
        ``_extra_state`` objects under their checkpoint names; what ``dist_checkpointing.save``
        writes and ``dist_checkpointing.load`` fills. The keys and shards are those of the
        trainer's torch_dist checkpoints. ``metadata`` (megatron-core's format switches) is
        accepted and changes nothing; ``sharded_offsets`` (extra leading axes) is refused."""
        del metadata
        if sharded_offsets:
            raise ValueError("sharded_state_dict: sharded_offsets are not supported")
        pgs = self.pg_collection
        entries, by_param = model_sharded_state_dict(
            [self], pgs.tp_rank, pgs.tp_size, pgs.expt_tp_rank, pgs.expt_tp_size
        )
        out = {}
        for key, tensor in self.state_dict(keep_vars=True).items():
            entry = by_param.get(id(tensor)) if torch.is_tensor(tensor) else None
            if entry is None:
                continue
            if tuple(entry.data.shape) != tuple(tensor.shape):
                entry = dataclasses.replace(entry, local_shape=tuple(tensor.shape))
            out[prefix + key] = entry
        for name, entry in entries.items():
            # The extra-state objects and the second keys of CHECKPOINT_ALIASES: written, and
            # not part of this model's own state dict.
            if isinstance(entry, ShardedObject) or entry.optional:
                out[prefix + name] = entry
        return out

    def _transformer_blocks(self) -> List[TransformerBlock]:
        return [m for m in self.children() if isinstance(m, TransformerBlock)]

    def set_moe_aux_loss_scale(self, scale) -> None:
        for block in self._transformer_blocks():
            block.set_moe_aux_loss_scale(scale)
        if getattr(self, "mtp", None) is not None:  # MoE layers of multi-token prediction
            self.mtp.set_moe_aux_loss_scale(scale)

    def moe_metrics(self, names: Sequence[str], num_layers: int) -> torch.Tensor:
        """[len(names), num_layers] float32: the auxiliary losses the MoE routers of this model
        (chunk) tracked under ``names`` (Megatron's log names), this step's sums on this rank,
        at each MoE layer's global layer number - 1; 0 for the other layers. With multi-token
        prediction D more columns hold the MTP depths'. The caller reduces them across ranks and
        micro-batches."""
        values = torch.zeros(len(names), num_layers, dtype=torch.float32, device=compute_device())
        for block in self._transformer_blocks():
            values += block.moe_metrics(names, num_layers)
        depths = getattr(self.config, "mtp_num_layers", None) or 0
        if depths:  # the MTP depths' MoE layers follow the model's (Megatron's tracker)
            mtp = getattr(self, "mtp", None)
            extra = torch.zeros(len(names), depths, dtype=torch.float32, device=values.device)
            values = torch.cat([values, extra if mtp is None else mtp.moe_metrics(names)], 1)
        return values

    def reset_moe_metrics(self) -> None:
        """Start the next step's sums (after :meth:`moe_metrics` has been read)."""
        for block in self._transformer_blocks():
            block.reset_moe_metrics()
        if getattr(self, "mtp", None) is not None:
            self.mtp.reset_moe_metrics()

    def compute_language_model_loss(
        self, labels: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor:
        """Per-token loss [b, s] from labels [b, s] and logits [b, s, V] (or this tensor-parallel
        rank's vocab slice [b, s, V/TP], the model's ``tp_group`` set).

        Computed in fp32 unless ``fp16_lm_cross_entropy`` (then in the logits' dtype).
        """
        if not getattr(self, "fp16_lm_cross_entropy", False):
            logits = logits.float()
        tp_group = getattr(self, "tp_group", None)
        vocab_size = getattr(self, "vocab_size", None)
        if group_size(tp_group) > 1 and logits.shape[-1] != vocab_size:
            return vocab_parallel_cross_entropy(logits, labels, tp_group=tp_group)
        return language_model_cross_entropy(logits, labels)

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Multiply the logits by ``mup_output_mult`` under muP (``--use-mup``)."""
        config = self.config
        if not config.use_mup or config.mup_output_mult == 1.0:
            return logits
        return logits * config.mup_output_mult

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The word embedding on the first stage (and on the stage of multi-token prediction,
        which holds the embedding and, tied, no output weight of its own), else the output
        layer's weight."""
        if self.pre_process or getattr(self, "mtp_process", False):
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def setup_embeddings_and_output_layer(self) -> None:
        """Mark the embedding / output weights with the attributes that Megatron's method of this
        name sets.

        ``is_embedding_or_output_parameter`` is set on the word embedding (first stage) and on the
        output layer's own weight (last stage) for the optimizer's decoupled LR and Muon; under
        muP ``is_embedding_parameter`` marks every embedding table and the output weight. With
        tied weights and the model split over pipeline stages, the last stage holds a zero-filled
        copy marked ``shared = True`` (``shared_embedding = True`` on both copies); as in
        megatron-core, it receives the first stage's values here (:meth:`sync_shared_embedding`, a
        collective of the two stages) when ``pg_collection`` names the embedding group, and
        gradients are all-reduced over that group. With one stage holding both ends, no marker is
        needed.
        """
        if self.pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        if self.config.use_mup:
            # muP's embedding class (base learning rate and Adam epsilon): every embedding
            # table and the output layer, whose logits are scaled by 1/width instead.
            embedding_class = list(self.embedding.parameters()) if self.pre_process else []
            if self.post_process and self.output_layer.weight is not None:
                embedding_class.append(self.output_layer.weight)
            for param in embedding_class:
                param.is_embedding_parameter = True
        if not self._embedding_on_both_ends():
            return
        if self.pre_process and not self.post_process:
            self.embedding.word_embeddings.weight.shared_embedding = True
        if self.post_process and not self.pre_process:
            weight = self.shared_embedding_or_output_weight()
            if weight.device.type != "meta":
                with torch.no_grad():
                    weight.zero_()
            weight.shared = True
            weight.shared_embedding = True
        embedding_group = getattr(self.pg_collection, "embd", None)
        if torch.distributed.is_initialized() and group_size(embedding_group) > 1:
            self.sync_shared_embedding(embedding_group)

    def _embedding_on_both_ends(self) -> bool:
        """Whether the last pipeline stage holds a copy of the word embedding: tied output
        weights, or multi-token prediction (Megatron's ``mtp_num_layers``), which embeds there."""
        return bool(
            self.share_embeddings_and_output_weights or getattr(self.config, "mtp_num_layers", None)
        )

    def sync_shared_embedding(self, embedding_group) -> None:
        """All-reduce (sum) the tied weight over the group of the first and last pipeline stage,
        copying the first stage's initial values into the last stage's zeroed copy."""
        if not self._embedding_on_both_ends() or (self.pre_process and self.post_process):
            return
        weight = self.shared_embedding_or_output_weight()
        if weight is not None and embedding_group is not None:
            # The model may still be on the host (built before .to(device)): reduce on the
            # group's device and copy back.
            on_group = weight.data.to(collective_device(embedding_group))
            torch.distributed.all_reduce(on_group, group=embedding_group)
            weight.data.copy_(on_group)
