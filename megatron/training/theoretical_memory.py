"""Theoretical memory per GPU of a GPT run, computed from the validated flags (nothing is built).

Two parts, the two that Megatron's report prints (weight and optimizer, activation):

* **weights and optimizer**: the parameters this rank holds (exact count of the local GPT layer
  spec, split by TP, PP stage, with the word embedding on the first stage and the output layer,
  or the tied embedding's copy, on the last one; the MoE layers of each stage by
  ``--moe-layer-freq``; multi-latent attention and the MTP depths on the last stage included)
  times the bytes per parameter of the precision and optimizer: weights (4 fp32 / 2 fp16,
  bf16), gradients (4 when fp32 or with ``--accumulate-allreduce-grads-in-fp32``, else 2) and
  optimizer state (Adam: two fp32 moments; SGD: one momentum buffer, none with
  ``--sgd-momentum 0``; with 16-bit params also the fp32 master copy, and with 16-bit
  gradients the fp32 copy of the gradient the optimizer steps on).
  ``--use-distributed-optimizer`` divides the optimizer state (and, with ``--use-megatron-fsdp
  --data-parallel-sharding-strategy optim_grads``, ZeRO-2, the gradients too) by the
  data-parallel x context-parallel size (the group the distributed optimizer shards over):
  fp32 16 -> 8 + 8/d, bf16 with fp32 grads 18 -> 6 + 12/d, fp16 20 -> 4 + 16/d bytes per
  parameter. The routed experts' state is sharded over the expert-data-parallel group instead,
  world / (expert TP x EP x PP) = DP x CP x TP / (EP x ETP) ranks.
* **activations**: Korthikanti et al. 2022 (Megatron's formula), for the micro-batches in flight
  on this pipeline rank. Per layer and micro-batch, in bytes with 16-bit activations:
  ``s*b*h*(18 + 4*ffn/h) + 5*a*s^2*b`` (= sbh(34 + 5as/h) for ffn = 4h). The attention-score
  term (softmax output, its dropout mask and output) is counted only where the attention that
  will run keeps the scores for backward: the unfused path (``--attention-backend
  unfused``/``local``, and ``auto`` for fp32 on CPU up to 1024 tokens; see
  ``dot_product_attention.unfused_attention_runs``). SDPA's flash / memory-efficient kernels (what
  ``auto`` runs on a GPU), ring attention (CP) and calls with a mask tensor (BERT, T5's encoder,
  ``--reset-attention-mask``) keep one statistic per query row instead. Without sequence
  parallelism only the parts inside the tensor-parallel regions (8 + 4*ffn/h and the attention
  scores) are divided by TP; with it everything is. Selective recompute of ``core_attn`` drops
  the attention-score term, of ``mlp`` the two ffn-wide tensors; full recompute keeps only the
  input of each checkpointed chunk (2*s*b*h, divided by TP with sequence parallelism or
  ``--distribute-saved-activations``) plus, once, the activations of the chunk being recomputed.
  fp32 activations double every term except the 1-byte dropout masks. Context parallelism
  divides the sequence by CP (the score term keeps the full key length). The first stage adds the
  token ids and the embedding dropout mask per micro-batch; the stage with the output layer adds
  its input and the fp32 logits for one micro-batch (Megatron: 4*s*b*h*(1 + V/h) / TP); with
  ``--cross-entropy-loss-fusion`` the fp32 logits of one chunk of tokens instead (the chunked
  fused loss keeps no more; see ``fused_linear_cross_entropy.chunk_rows``). With
  ``--mtp-num-layers`` the last stage adds, per depth, one layer's activations, the inputs of
  its two norms and of eh_proj (4*s*b*h elements) and a second output layer and loss (with full
  uniform recompute, the depth's two inputs: Megatron recomputes each depth). A multi-latent
  attention layer replaces the formula's attention terms by what it saves (its latents, the
  rotated q and k, the kv up-projection's output, the output projection's input:
  ``mla_attention_elements``, checked against the tensors one layer saves in
  tests/unit_tests/training/test_theoretical_memory_mla.py); Megatron's report counts it as
  standard attention.

Micro-batches in flight: 1 without pipelining; min(PP - rank, M) for 1F1B; with the interleaved
schedule (warm-up + 1) model-chunk micro-batches, warm-up = 2*(PP - rank - 1) + (VP - 1)*G, which
on rank 0 equals Megatron's factor 1 + (PP - 1)/(PP*VP) times PP micro-batches.

Differences from Megatron's report, on purpose: Megatron prints activations only with sequence
parallelism and selective recompute (the case its formula assumes) and counts 18 bytes/param
whatever the precision; here activations are printed for every recompute choice and the bytes per
parameter follow the precision, and the parameter count is exact for this code base's model.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron.core.fusions.fused_linear_cross_entropy import chunk_rows
from megatron.core.transformer.config_rules import linear_attention_pattern
from megatron.core.transformer.dot_product_attention import unfused_attention_runs
from megatron.training.theoretical_memory_mla import (
    mla_attention_elements,
    mla_head_dims_differ,
    mla_takes_sdpa_math,
)

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


# ----------------------------------------------------------------------------- parameters
@dataclass
class ParameterCount:
    """Parameters of a GPT built from the flags (the local layer spec of this code base)."""

    embedding: int
    """Word embedding (padded vocab x hidden)."""
    position_embedding: int
    """Learned absolute position embedding (0 for rope / none)."""
    per_layer: int
    """One transformer layer: norms, QKV, projection, MLP, with their biases."""
    per_layer_replicated: int
    """The part of ``per_layer`` every tensor-parallel rank holds whole (norms, row-parallel
    biases)."""
    final_norm: int
    """The final layer norm (on the last pipeline stage)."""
    output_layer: int
    """Separate output projection (0 when tied to the word embedding)."""
    num_layers: int
    """Transformer layers of the whole model."""
    num_moe_layers: int = 0
    """Layers whose MLP is a mixture of experts (``--num-experts``, ``--moe-layer-freq``)."""
    moe_layer: int = 0
    """One MoE layer: ``per_layer`` with the MLP replaced by router, shared expert and experts."""
    moe_layer_replicated: int = 0
    """The part of ``moe_layer`` every TP rank holds whole (norms, router, shared-expert gate,
    row-parallel biases)."""
    moe_experts: int = 0
    """The routed experts of one MoE layer (all of them), split over EP x ETP."""
    expert_shards: int = 1
    """EP x ETP: the ranks the experts of a layer are spread over."""
    mtp_layers: int = 0
    """Multi-token-prediction depths (``--mtp-num-layers``), on the last pipeline stage: each a
    transformer layer like the model's last, plus ``mtp_extra``."""
    mtp_is_moe: bool = False
    """Whether the MTP layers are MoE layers (the model's last layer is)."""
    mtp_extra: int = 0
    """One depth's enorm, hnorm, final norm and eh_proj [h, 2h]."""
    mtp_extra_replicated: int = 0
    """The part of ``mtp_extra`` every TP rank holds whole (the norms)."""
    layers_by_rank: Tuple[int, ...] = ()
    """Decoder layers on each pipeline rank (all its model chunks); empty: unknown."""
    moe_layers_by_rank: Tuple[int, ...] = ()
    """Of ``layers_by_rank``, the MoE layers (which layers are MoE follows ``--moe-layer-freq``,
    e.g. DeepSeek's dense first layers on the first stage); empty: assumed spread evenly."""
    num_linear_layers: int = 0
    """Gated delta net layers (``--linear-attention-freq``): their attention differs."""
    linear_delta: int = 0
    """A gated delta net layer's parameters minus a softmax-attention layer's (``per_layer``)."""
    linear_delta_replicated: int = 0
    """The part of ``linear_delta`` every TP rank holds whole (out_norm minus the QK norms)."""
    layers_remainder: int = 0
    """What the layers hold beyond ``num_layers x per_layer`` where they differ (a hybrid model,
    whose ``per_layer`` is the floored mean of its layers)."""

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.position_embedding
            + (self.num_layers - self.num_moe_layers) * self.per_layer
            + self.num_moe_layers * self.moe_layer
            + self.num_linear_layers * self.linear_delta
            + self.layers_remainder
            + self.final_norm
            + self.output_layer
            + self.mtp_total
        )

    @property
    def mtp_total(self) -> int:
        """The multi-token-prediction depths (their layers and ``mtp_extra``); the rest of
        ``total`` is the main model."""
        layer = self.moe_layer if self.mtp_is_moe else self.per_layer
        return self.mtp_layers * (layer + self.mtp_extra)

    @property
    def mtp_experts(self) -> int:
        """The routed experts of the MTP depths (all of them)."""
        return self.mtp_layers * self.moe_experts if self.mtp_is_moe else 0

    def layer_on_tp_rank(self, tp: int) -> int:
        """Parameters of one dense layer on one tensor-parallel rank."""
        return (self.per_layer - self.per_layer_replicated) // tp + self.per_layer_replicated

    def experts_on_rank(
        self, layers: int, pp_rank: Optional[int] = None, pp: Optional[int] = None
    ) -> int:
        """The routed-expert parameters among those of pipeline rank ``pp_rank`` of ``pp``
        holding ``layers`` layers (its EP x ETP share of each of its MoE layers' experts, the
        MoE MTP depths' on the last stage)."""
        moe = self._moe_layers_among(layers, pp_rank)
        if pp is not None and pp_rank == pp - 1 and self.mtp_is_moe:
            moe += self.mtp_layers
        return moe * (self.moe_experts // self.expert_shards)

    def _moe_layers_among(self, layers: int, pp_rank: Optional[int] = None) -> int:
        """MoE layers among the ``layers`` layers of pipeline rank ``pp_rank``: exact where the
        rank's layers are known (``moe_layers_by_rank``), else assumed spread evenly over the
        stages (exact with every layer MoE)."""
        known = self.moe_layers_by_rank
        if pp_rank is not None and pp_rank < len(known):
            if layers == self.layers_by_rank[pp_rank]:
                return known[pp_rank]
        return round(layers * self.num_moe_layers / self.num_layers) if self.num_layers else 0

    def moe_layer_on_rank(self, tp: int) -> int:
        """Parameters of one MoE layer on one rank: its experts' share plus the TP share of
        the rest."""
        split = self.moe_layer - self.moe_layer_replicated - self.moe_experts
        return split // tp + self.moe_layer_replicated + self.moe_experts // self.expert_shards

    def on_rank(self, tp: int, pp: int, pp_rank: int, layers: int) -> int:
        """Parameters on pipeline rank ``pp_rank`` holding ``layers`` layers, per TP rank. With tied
        embeddings and PP > 1 the last stage keeps its own copy of the word embedding (Megatron).
        Which of its layers are MoE layers: see ``_moe_layers_among``."""
        moe = self._moe_layers_among(layers, pp_rank)
        count = (layers - moe) * self.layer_on_tp_rank(tp) + moe * self.moe_layer_on_rank(tp)
        if self.num_linear_layers:  # assumed spread evenly over the stages, as MoE layers
            linear = round(layers * self.num_linear_layers / self.num_layers)
            split = self.linear_delta - self.linear_delta_replicated
            count += linear * (split // tp + self.linear_delta_replicated)
        # Under one parameter per layer: counted whole on every TP rank (an upper bound).
        count += math.ceil(self.layers_remainder * layers / self.num_layers)
        if pp_rank == 0:
            count += self.embedding // tp + self.position_embedding
        if pp_rank == pp - 1:
            count += self.final_norm
            if self.output_layer:
                count += self.output_layer // tp
            if pp > 1 and (not self.output_layer or self.mtp_layers):
                count += self.embedding // tp  # the last stage's copy of the word embedding
            count += self.mtp_layers * self._mtp_layer_on_rank(tp)
        return count

    def _mtp_layer_on_rank(self, tp: int) -> int:
        layer = self.moe_layer_on_rank(tp) if self.mtp_is_moe else self.layer_on_tp_rank(tp)
        split = self.mtp_extra - self.mtp_extra_replicated
        return layer + split // tp + self.mtp_extra_replicated

    def rank_layers(self, pp: int) -> List[int]:
        """Layers of each pipeline rank: the flags' split where known, else an even split."""
        if len(self.layers_by_rank) == pp:
            return list(self.layers_by_rank)
        return [math.ceil(self.num_layers / pp)] * pp

    def largest_rank(self, tp: int, pp: int) -> int:
        """Parameters on the most loaded (tensor, pipeline) rank."""
        layers = self.rank_layers(pp)
        return max(self.on_rank(tp, pp, rank, layers[rank]) for rank in range(pp))


def _norm_size(args, width: int) -> int:
    return width if args.normalization == "RMSNorm" else 2 * width


def count_parameters(args, padded_vocab_size: Optional[int]) -> ParameterCount:
    """The parameter count of the validated ``args`` (vocab part 0 when the vocab is unknown)."""
    hidden, ffn = args.hidden_size, args.ffn_hidden_size
    query_width = args.num_attention_heads * args.kv_channels
    kv_width = args.num_query_groups * args.kv_channels
    bias = bool(args.add_bias_linear)
    qkv_bias = bool(args.add_qkv_bias) or bias
    fc1_rows = 2 * ffn if args.swiglu else ffn
    norms = 2 * _norm_size(args, hidden)
    if args.qk_layernorm:
        norms += 2 * _norm_size(args, args.kv_channels)
    # With --attention-output-gate linear_qkv also computes a gate per query channel.
    q_rows = 2 * query_width if getattr(args, "attention_output_gate", False) else query_width
    qkv = hidden * (q_rows + 2 * kv_width) + (q_rows + 2 * kv_width if qkv_bias else 0)
    proj = query_width * hidden
    if getattr(args, "multi_latent_attention", False):
        qkv, proj, norms = _mla_sizes(args)
    fc1 = hidden * fc1_rows + (fc1_rows if bias else 0)
    fc2 = ffn * hidden
    row_biases = 2 * hidden if bias else 0
    vocab = padded_vocab_size or 0
    learned = args.position_embedding_type == "learned_absolute"
    count = ParameterCount(
        embedding=vocab * hidden,
        position_embedding=args.max_position_embeddings * hidden if learned else 0,
        per_layer=norms + qkv + proj + fc1 + fc2 + row_biases,
        per_layer_replicated=norms + row_biases,
        final_norm=_norm_size(args, hidden),
        output_layer=vocab * hidden if args.untie_embeddings_and_output_weights else 0,
        num_layers=args.num_layers,
    )
    if getattr(args, "num_experts", None):
        _add_experts(count, args, hidden, bias, qkv + proj + norms)
    if getattr(args, "experimental_attention_variant", None) == "gated_delta_net":
        qk_norms = 2 * _norm_size(args, args.kv_channels) if args.qk_layernorm else 0
        # linear_proj's bias is replicated; the gated delta net's projections have no biases.
        _add_gated_delta_net(count, args, qkv + proj, qk_norms + (hidden if bias else 0))
    if getattr(args, "mtp_num_layers", None):
        count.mtp_layers = args.mtp_num_layers
        freq = getattr(args, "moe_layer_freq", 1)
        last = args.num_layers - 1
        count.mtp_is_moe = bool(count.num_moe_layers) and bool(
            freq[-1] if isinstance(freq, (list, tuple)) else last % freq == 0
        )
        count.mtp_extra_replicated = 3 * _norm_size(args, hidden)
        count.mtp_extra = count.mtp_extra_replicated + 2 * hidden * hidden
    return count


def _add_gated_delta_net(count: ParameterCount, args, softmax_split: int, softmax_replicated: int):
    """Gated delta net layers: in_proj [q, k, v, z, beta, alpha], conv1d, dt_bias, A_log (all
    split over TP), out_norm over a value head (replicated), out_proj (no biases), in place of a
    softmax-attention layer's linear_qkv and linear_proj (``softmax_split``), QK norms and
    linear_proj bias (``softmax_replicated``)."""
    hidden = args.hidden_size
    qk = args.linear_key_head_dim * args.linear_num_key_heads
    v = args.linear_value_head_dim * args.linear_num_value_heads
    nv = args.linear_num_value_heads
    split = hidden * (2 * qk + 2 * v + 2 * nv) + args.linear_conv_kernel_dim * (2 * qk + v)
    split += 2 * nv + v * hidden
    out_norm = _norm_size(args, args.linear_value_head_dim)
    count.num_linear_layers = sum(
        linear_attention_pattern(args.linear_attention_freq, args.num_layers)
    )
    replicated = out_norm - softmax_replicated
    count.linear_delta = split - softmax_split + replicated
    count.linear_delta_replicated = replicated


def _mla_sizes(args):
    """(projections before attention, output projection, norms) of a multi-latent attention
    layer: q (or its down/up pair), kv down and up, the latent norms with --qk-layernorm."""
    hidden, heads = args.hidden_size, args.num_attention_heads
    q_width = heads * (args.qk_head_dim + args.qk_pos_emb_head_dim)
    rank_q, rank_kv = args.q_lora_rank, args.kv_lora_rank
    q = hidden * q_width if rank_q is None else rank_q * (hidden + q_width)
    kv = hidden * (rank_kv + args.qk_pos_emb_head_dim)
    kv += rank_kv * heads * (args.qk_head_dim + args.v_head_dim)
    norms = 2 * _norm_size(args, hidden)
    if args.qk_layernorm:
        norms += _norm_size(args, rank_kv) + (_norm_size(args, rank_q) if rank_q else 0)
    return q + kv, heads * args.v_head_dim * hidden, norms


def _mlp_size(hidden: int, ffn: int, gated: bool, bias: bool) -> int:
    fc1_rows = 2 * ffn if gated else ffn
    return hidden * fc1_rows + ffn * hidden + ((fc1_rows + hidden) if bias else 0)


def _add_experts(count: ParameterCount, args, hidden: int, bias: bool, attention: int) -> None:
    """MoE layers: router [E, h], E experts of width moe_ffn (with their biases), an optional
    shared expert (and its gate [1, h])."""
    experts = args.num_experts
    freq = args.moe_layer_freq
    pattern = _moe_pattern(freq, args.num_layers)
    count.num_moe_layers = sum(pattern)
    indices = layer_indices_by_rank(args)
    count.layers_by_rank = tuple(len(layers) for layers in indices)
    count.moe_layers_by_rank = tuple(sum(pattern[i] for i in layers) for layers in indices)
    moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    count.moe_experts = experts * _mlp_size(hidden, moe_ffn, args.swiglu, bias)
    router = experts * hidden
    shared_width = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
    shared = _mlp_size(hidden, shared_width, args.swiglu, bias) if shared_width else 0
    gate = hidden if shared_width and args.moe_shared_expert_gate else 0
    proj_bias = hidden if bias else 0
    shared_bias = hidden if shared_width and bias else 0
    count.moe_layer = attention + proj_bias + router + gate + shared + count.moe_experts
    count.moe_layer_replicated = (
        count.per_layer_replicated
        - (2 * hidden if bias else 0)
        + proj_bias
        + router
        + gate
        + shared_bias
    )
    count.expert_shards = args.expert_model_parallel_size * (
        args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    )


def _moe_pattern(freq, num_layers: int) -> List[bool]:
    """Whether each layer (0-based global index) is an MoE layer, by ``--moe-layer-freq`` (an
    interval, or one 0/1 per layer: DeepSeek-V3's ``([0]*3+[1]*58)``)."""
    if isinstance(freq, (list, tuple)):
        return [bool(v) for v in freq]
    return [i % freq == 0 for i in range(num_layers)]


def layer_indices_by_rank(args) -> List[List[int]]:
    """Global indices of the decoder layers on each pipeline rank (all its model chunks)."""
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    if pp == 1:
        return [list(range(args.num_layers))]
    split = _layer_split(args)
    return [
        [
            split.offset_for(rank, chunk) + i
            for chunk in range(split.num_chunks)
            for i in range(split.counts[rank][chunk])
        ]
        for rank in range(pp)
    ]


def layers_per_pipeline_rank(args) -> List[int]:
    """Decoder layers on each pipeline rank (all its model chunks), Megatron's split rules."""
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    if pp == 1:
        return [args.num_layers]
    split = _layer_split(args)
    return [sum(split.counts[rank]) for rank in range(pp)]


def _layer_split(args):
    from megatron.core.pipeline_parallel.layer_split import compute_layer_split

    pp = getattr(args, "pipeline_model_parallel_size", 1)
    return compute_layer_split(
        args.num_layers,
        pp,
        getattr(args, "virtual_pipeline_model_parallel_size", None),
        getattr(args, "decoder_first_pipeline_num_layers", None),
        getattr(args, "decoder_last_pipeline_num_layers", None),
        bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
        bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
        getattr(args, "pipeline_model_parallel_layout", None),
    )


# ----------------------------------------------------------------------------- bytes per parameter
@dataclass
class BytesPerParameter:
    """Bytes one parameter costs on one GPU, split as Megatron's report does."""

    weight: float
    """Model weight (4 fp32, 2 fp16/bf16)."""
    grad: float
    """Gradient buffer (4 fp32 or accumulated in fp32, else 2)."""
    optimizer: float
    """Optimizer state on this rank: fp32 master copy, moments and fp32 gradient copy, already
    divided by the sharding degree with the distributed optimizer."""
    optimizer_unsharded: float
    """Optimizer state without the distributed optimizer."""
    shards: int
    """Ranks the optimizer state is sharded over (1 without the distributed optimizer)."""
    params_sharded: bool = False
    """Weights and gradients are sharded over the same ranks too (FSDP2)."""
    expert_optimizer: Optional[float] = None
    """Optimizer state on this rank of a routed-expert parameter (the distributed optimizer
    shards it over the expert-data-parallel group); None: the same as ``optimizer``."""
    expert_shards: int = 1
    """Ranks the routed experts' optimizer state is sharded over."""
    grads_sharded: bool = False
    """The gradients are sharded like the optimizer state (Megatron-FSDP's optim_grads, ZeRO-2):
    ``grad`` and ``expert_grad`` are already divided."""
    expert_grad: Optional[float] = None
    """Gradient bytes on this rank of a routed-expert parameter; None: the same as ``grad``."""

    def __post_init__(self):
        if self.expert_optimizer is None:
            self.expert_optimizer = self.optimizer
            self.expert_shards = self.shards
        if self.expert_grad is None:
            self.expert_grad = self.grad

    @property
    def total(self) -> float:
        """Of a dense (not routed-expert) parameter."""
        return self.weight + self.grad + self.optimizer


def _half_precision(args) -> bool:
    return bool(getattr(args, "fp16", False) or getattr(args, "bf16", False))


def optimizer_shards(args) -> int:
    """Ranks the distributed optimizer shards its state over (data parallel x context parallel,
    divided among ``--num-distributed-optimizer-instances``); 1 without it."""
    if not getattr(args, "use_distributed_optimizer", False):
        return 1
    ranks = getattr(args, "data_parallel_size", 1) * getattr(args, "context_parallel_size", 1)
    instances = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    return max(1, ranks // instances)


def expert_optimizer_shards(args) -> int:
    """Ranks the distributed optimizer shards the routed experts' state over: the
    expert-data-parallel group (the DDP wrapper reduces the expert gradients over it), world /
    (expert TP x EP x PP) = DP x CP x TP / (EP x ETP); 1 without the distributed optimizer."""
    if not getattr(args, "use_distributed_optimizer", False):
        return 1
    tp = getattr(args, "tensor_model_parallel_size", 1)
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    ep = getattr(args, "expert_model_parallel_size", 1)
    ranks = getattr(args, "data_parallel_size", 1) * getattr(args, "context_parallel_size", 1) * tp
    instances = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    return max(1, ranks // (ep * etp) // instances)


def bytes_per_parameter(args) -> BytesPerParameter:
    """Weights + gradients + optimizer state per parameter for the flags."""
    half = _half_precision(args)
    weight = 2 if half else 4
    fp32_grads = not half or bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False))
    grad = 4 if fp32_grads else 2
    if getattr(args, "optimizer", "adam") == "sgd":
        moments = 4 if getattr(args, "sgd_momentum", 0.9) else 0
    else:
        moments = 8
    optimizer = moments
    if half:
        optimizer += 4  # fp32 master weights
        if not fp32_grads:
            optimizer += 4  # fp32 copy of the 16-bit gradient that the master weights step on
    if fully_sharded(args):
        # FSDP2 shards weights, gradients and optimizer state alike over data x context parallel
        # (the transient all-gathered layer is not counted, as Megatron's report does not).
        shards = max(
            1, getattr(args, "data_parallel_size", 1) * getattr(args, "context_parallel_size", 1)
        )
        return BytesPerParameter(
            weight=weight / shards,
            grad=grad / shards,
            optimizer=optimizer / shards,
            optimizer_unsharded=optimizer,
            shards=shards,
            params_sharded=True,
        )
    shards = optimizer_shards(args)
    expert_shards = expert_optimizer_shards(args)
    # ZeRO-2 keeps only this rank's slice of each gradient (the bucket being reduced is
    # transient, as the all-gathered layer of FSDP2 is, and is not counted either).
    grads_sharded = gradients_sharded(args)
    return BytesPerParameter(
        weight=weight,
        grad=grad / shards if grads_sharded else grad,
        expert_grad=grad / expert_shards if grads_sharded else grad,
        grads_sharded=grads_sharded,
        optimizer=optimizer / shards,
        optimizer_unsharded=optimizer,
        shards=shards,
        expert_optimizer=optimizer / expert_shards,
        expert_shards=expert_shards,
    )


def fully_sharded(args) -> bool:
    """FSDP2: --use-torch-fsdp2, or --use-megatron-fsdp with the optim_grads_params strategy."""
    return bool(getattr(args, "use_torch_fsdp2", False)) or (
        bool(getattr(args, "use_megatron_fsdp", False))
        and getattr(args, "data_parallel_sharding_strategy", "optim_grads_params")
        == "optim_grads_params"
    )


def gradients_sharded(args) -> bool:
    """ZeRO-2: --use-megatron-fsdp with the optim_grads strategy (the distributed optimizer keeping
    only its slice of the gradients)."""
    return (
        bool(getattr(args, "use_megatron_fsdp", False))
        and getattr(args, "data_parallel_sharding_strategy", None) == "optim_grads"
        and bool(getattr(args, "use_distributed_optimizer", False))
    )


# ----------------------------------------------------------------------------- activations
def num_microbatches_from_args(args) -> int:
    """Micro-batches per step: global batch / (micro batch x data parallel)."""
    gbs = getattr(args, "global_batch_size", None)
    mbs, dp = args.micro_batch_size, getattr(args, "data_parallel_size", 1)
    if gbs is None:
        return 1
    return max(1, gbs // (mbs * dp))


def microbatches_in_flight(args, num_microbatches: int, pp_rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``pp_rank`` holds at its peak. With the
    interleaved schedule this is (model-chunk micro-batches in flight) / VP, so that multiplied
    by the layers of the rank it counts the layers' activations held."""
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    if pp == 1:
        return 1
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    if vp == 1:
        return min(pp - pp_rank, num_microbatches)
    group = getattr(args, "microbatch_group_size_per_vp_stage", None) or pp
    warmup = 2 * (pp - pp_rank - 1) + (vp - 1) * group
    return min(warmup + 1, num_microbatches * vp) / vp


@dataclass
class LayerActivations:
    """Activation bytes one transformer layer saves for backward, for one micro-batch."""

    outside_tp: float
    """Norm inputs, QKV / fc1 inputs and dropout masks (split by TP only with sequence
    parallelism)."""
    inside_tp: float
    """Tensors inside the tensor-parallel regions: Q, K, V, projection input, MLP intermediates."""
    attention_scores: float
    """Softmax output, its dropout mask and dropout output (the 5as^2b term)."""

    @property
    def total(self) -> float:
        return self.outside_tp + self.inside_tp + self.attention_scores


def _activation_dtype(args) -> torch.dtype:
    if getattr(args, "bf16", False):
        return torch.bfloat16
    return torch.float16 if getattr(args, "fp16", False) else torch.float32


def _backend_name(value) -> str:
    """--attention-backend's name (an AttnBackend member, or its name from a checkpoint)."""
    return getattr(value, "name", value) or "auto"


def attention_keeps_scores(args, device_type: str = "cuda", explicit_mask: bool = False) -> bool:
    """Whether the attention the run will take keeps its s x s scores for backward: only the
    unfused path does, and on a CPU torch's math fallback, which multi-latent attention with
    value heads of another width takes (mla_takes_sdpa_math). ``explicit_mask``: the model hands
    attention a mask tensor (BERT's and T5's padding masks), which always takes SDPA; GPT builds
    one with --reset-attention-mask."""
    if getattr(args, "context_parallel_size", 1) > 1:
        return False  # ring attention: a row statistic per query block
    if mla_head_dims_differ(args):
        return mla_takes_sdpa_math(args, device_type)
    if explicit_mask or getattr(args, "reset_attention_mask", False):
        return False
    return unfused_attention_runs(
        _backend_name(getattr(args, "attention_backend", "auto")),
        _activation_dtype(args),
        device_type,
        args.seq_length,
    )


def layer_activation_bytes(
    args, device_type: str = "cuda", explicit_mask: bool = False
) -> LayerActivations:
    """Per-layer activations of one micro-batch on one TP rank, with selective recompute applied,
    on ``device_type`` (which decides the attention path of ``--attention-backend auto``)."""
    scale = 1.0 if _half_precision(args) else 2.0  # the formula counts 2-byte activations
    tp = getattr(args, "tensor_model_parallel_size", 1)
    cp = getattr(args, "context_parallel_size", 1)
    sp = bool(getattr(args, "sequence_parallel", False)) and tp > 1
    seq, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    s = seq / cp
    sbh = s * b * h
    ffn_ratio = args.ffn_hidden_size / h
    # Outside TP: two norm inputs (4), QKV and fc1 inputs (4 total) and two dropout masks
    # (2 x 1 byte).
    outside = (8 * scale + 2) * sbh
    inside = (8 + 4 * ffn_ratio) * scale * sbh / tp  # Q, K (4), V (2), proj input (2), MLP 4*ffn/h
    scores = (4 * scale + 1) * args.num_attention_heads * s * seq * b / tp
    if getattr(args, "multi_latent_attention", False):
        # Replace the standard attention's tensors (2 outside, 4 inside TP, h wide) by MLA's.
        mla_outside, mla_inside = mla_attention_elements(args, sp)
        outside += 2 * scale * s * b * (mla_outside - 2 * h)
        inside += 2 * scale * s * b * (mla_inside - 4 * h) / tp
        if mla_takes_sdpa_math(args, device_type):
            # torch's math fallback keeps fp32 probabilities (and their dropout) in any dtype.
            scores = 9 * args.num_attention_heads * s * seq * b / tp
    if not attention_keeps_scores(args, device_type, explicit_mask):
        scores = 0.0
    if getattr(args, "recompute_granularity", None) == "selective":
        modules = getattr(args, "recompute_modules", None) or ["core_attn"]
        if "core_attn" in modules:
            scores = 0.0
        if "mlp" in modules:
            inside -= 4 * ffn_ratio * scale * sbh / tp
    if sp:
        outside /= tp
    return LayerActivations(outside_tp=outside, inside_tp=inside, attention_scores=scores)


def _checkpointed_input_bytes(args) -> float:
    """The saved input of one fully recomputed chunk of layers, for one micro-batch."""
    tp = getattr(args, "tensor_model_parallel_size", 1)
    cp = getattr(args, "context_parallel_size", 1)
    element = 2 if _half_precision(args) else 4
    saved = element * (args.seq_length / cp) * args.micro_batch_size * args.hidden_size
    sp = bool(getattr(args, "sequence_parallel", False)) and tp > 1
    if sp or getattr(args, "distribute_saved_activations", False):
        saved /= tp
    return saved


def _full_recompute_layers(args, layers_per_chunk: List[int]):
    """(checkpointed chunk inputs, layers stored whole, layers of the largest recomputed chunk)
    over the model chunks of one rank, one micro-batch each."""
    method, k = args.recompute_method, args.recompute_num_layers
    inputs = whole = working = 0
    for n in layers_per_chunk:
        if method == "uniform":
            inputs += math.ceil(n / k) if n else 0
            working = max(working, min(k, n))
        else:  # block: the first k layers of each chunk are recomputed one by one
            recomputed = min(k, n)
            inputs += recomputed
            whole += n - recomputed
            working = max(working, 1 if recomputed else 0)
    return inputs, whole, working


def activation_components(
    args,
    num_microbatches: Optional[int] = None,
    pp_rank: int = 0,
    layers: Optional[int] = None,
    device_type: str = "cuda",
    explicit_mask: bool = False,
) -> "OrderedDict[str, float]":
    """Activation bytes on pipeline rank ``pp_rank`` at its peak, by component (see
    layer_activation_bytes for ``device_type`` and ``explicit_mask``)."""
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    tp = getattr(args, "tensor_model_parallel_size", 1)
    cp = getattr(args, "context_parallel_size", 1)
    sp = bool(getattr(args, "sequence_parallel", False)) and tp > 1
    if num_microbatches is None:
        num_microbatches = num_microbatches_from_args(args)
    if layers is None:
        layers = layers_per_pipeline_rank(args)[pp_rank]
    in_flight = microbatches_in_flight(args, num_microbatches, pp_rank)
    per_layer = layer_activation_bytes(args, device_type, explicit_mask)
    parts: "OrderedDict[str, float]" = OrderedDict()
    if getattr(args, "recompute_granularity", None) == "full":
        vp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
        chunks = [layers // vp + (1 if c < layers % vp else 0) for c in range(vp)]
        inputs, whole, working = _full_recompute_layers(args, chunks)
        parts["transformer layers (checkpointed inputs)"] = (
            inputs * _checkpointed_input_bytes(args) * in_flight
        )
        parts["transformer layers (not recomputed)"] = whole * per_layer.total * in_flight
        parts["recompute working set (one chunk)"] = working * per_layer.total
    else:
        parts["transformer layers"] = layers * per_layer.total * in_flight
    s, b, h = args.seq_length / cp, args.micro_batch_size, args.hidden_size
    if pp_rank == 0:
        # int64 token ids (and labels' twin is on the last stage) plus the embedding dropout mask.
        mask = s * b * h / (tp if sp else 1)
        parts["embedding (token ids, dropout mask)"] = (8 * s * b + mask) * in_flight
    if pp_rank == pp - 1:
        vocab = getattr(args, "padded_vocab_size", None) or 0
        if getattr(args, "cross_entropy_loss_fusion", False) and vocab:
            # The chunked fused loss keeps one chunk's fp32 numerator, not [s*b, V/TP] logits.
            rows = chunk_rows(int(s * b), math.ceil(vocab / tp))
            parts["output layer and loss (input, fp32 logits of one chunk)"] = (
                4 * s * b * h / tp + 4 * rows * vocab / tp
            )
        else:
            parts["output layer and loss (input, fp32 logits)"] = (
                4 * s * b * h / tp + 4 * s * b * vocab / tp
            )
        mtp = getattr(args, "mtp_num_layers", None) or 0
        if mtp:
            # Each depth: a layer like the main ones, the enorm and hnorm inputs and eh_proj's
            # [s, b, 2h] input (4 hidden-sized tensors, split by TP with sequence parallelism),
            # and its own output layer and loss, counted as the main one's.
            element = 2 if _half_precision(args) else 4
            logits = next(v for k, v in parts.items() if k.startswith("output layer"))
            depth = per_layer.total + 4 * element * s * b * h / (tp if sp else 1)
            if _mtp_recomputed(args):
                # Each depth is one checkpointed chunk: it keeps its two inputs (h_{k-1} and the
                # embedding of the shifted tokens); its activations live only while recomputed.
                key = "recompute working set (one chunk)"
                parts[key] = max(parts[key], depth)
                depth = 2 * _checkpointed_input_bytes(args)
            parts["multi-token prediction (layers, eh_proj inputs, logits)"] = mtp * (
                depth * in_flight + logits
            )
    return parts


def _mtp_recomputed(args) -> bool:
    """MTP depths are recomputed with full recompute and the uniform method (Megatron skips
    them with the block method; multi_token_prediction.py)."""
    return (
        getattr(args, "recompute_granularity", None) == "full"
        and getattr(args, "recompute_method", None) == "uniform"
    )


# ----------------------------------------------------------------------------- the report
@dataclass
class TheoreticalMemory:
    """Memory of one pipeline rank (any of its TP / DP / CP ranks), in bytes."""

    pp_rank: int
    """The pipeline rank described."""
    parameters: int
    """Parameters this rank holds (one TP shard of its stage)."""
    per_parameter: BytesPerParameter
    """Bytes per parameter used for the weight, gradient and optimizer figures."""
    num_microbatches: int
    """Micro-batches per step used for the pipeline's in-flight count."""
    microbatches_in_flight: float
    """Micro-batches whose activations are held at the peak."""
    activations: Dict[str, float] = field(default_factory=dict)
    """Activation bytes by component."""
    expert_parameters: int = 0
    """Of ``parameters``, the routed experts' (their optimizer state is sharded otherwise)."""
    device_type: str = "cuda"
    """The device the activations were counted for (it decides the attention path of
    ``--attention-backend auto``)."""

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.per_parameter.weight

    @property
    def gradient_bytes(self) -> float:
        per = self.per_parameter
        dense = self.parameters - self.expert_parameters
        return dense * per.grad + self.expert_parameters * per.expert_grad

    @property
    def optimizer_bytes(self) -> float:
        per = self.per_parameter
        dense = self.parameters - self.expert_parameters
        return dense * per.optimizer + self.expert_parameters * per.expert_optimizer

    @property
    def weight_and_optimizer_bytes(self) -> float:
        """Weights + gradients + optimizer state (Megatron's 'weight and optimizer')."""
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def activation_bytes(self) -> float:
        return float(sum(self.activations.values()))

    @property
    def total_bytes(self) -> float:
        return self.weight_and_optimizer_bytes + self.activation_bytes

    def summary_line(self) -> str:
        """Megatron's line: ``Theoretical memory footprints: weight and optimizer=X MB, ...``."""
        mb = NUM_BYTES_IN_MEGABYTE
        return (
            f"Theoretical memory footprints: weight and optimizer="
            f"{self.weight_and_optimizer_bytes / mb:.2f} MB, "
            f"activation={self.activation_bytes / mb:.2f} MB, "
            f"total={self.total_bytes / mb:.2f} MB"
        )

    def breakdown_lines(self) -> List[str]:
        mb = NUM_BYTES_IN_MEGABYTE
        per = self.per_parameter
        what = "weights, gradients and optimizer" if per.params_sharded else "optimizer"
        if per.grads_sharded:
            what = "gradients and optimizer"
        sharded = f", {what} sharded over {per.shards} ranks" if per.shards > 1 else ""
        lines = [
            f"  pipeline rank {self.pp_rank}: {self.parameters} parameters "
            "per tensor-parallel rank, "
            f"{per.total:g} bytes/parameter (weight {per.weight:g} + gradient {per.grad:g} + "
            f"optimizer {per.optimizer:g}{sharded})",
            f"    weights: {self.weight_bytes / mb:.2f} MB",
            f"    gradients: {self.gradient_bytes / mb:.2f} MB",
            f"    optimizer state: {self.optimizer_bytes / mb:.2f} MB",
            f"    activations ({self.microbatches_in_flight:g} of {self.num_microbatches} "
            "micro-batches "
            f"in flight, on {self.device_type}): {self.activation_bytes / mb:.2f} MB",
        ]
        if self.expert_parameters and per.expert_shards != per.shards:
            lines.insert(
                1,
                f"    of which {self.expert_parameters} routed-expert parameters: optimizer "
                f"{per.expert_optimizer:g} bytes/parameter (sharded over {per.expert_shards} "
                "expert-data-parallel ranks)",
            )
        lines += [f"      {name}: {value / mb:.2f} MB" for name, value in self.activations.items()]
        return lines


def compute_theoretical_memory(
    args,
    num_microbatches: Optional[int] = None,
    pp_rank: int = 0,
    family=None,
    device_type: str = "cuda",
) -> TheoreticalMemory:
    """The theoretical memory of pipeline rank ``pp_rank`` for the validated ``args``
    (``args.padded_vocab_size`` must be set for the embedding terms; None counts them as 0),
    on ``device_type`` (a GPU unless told: the trainer passes the device it runs on).

    ``family`` (a ModelFamily) supplies the parameter count and the activations; None means the
    decoder-transformer (GPT) formulas of this module."""
    count_params = count_parameters if family is None else family.count_parameters
    activations = activation_components if family is None else family.activation_components
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    tp = getattr(args, "tensor_model_parallel_size", 1)
    if not 0 <= pp_rank < pp:
        raise ValueError(
            f"pipeline rank {pp_rank} out of range for --pipeline-model-parallel-size {pp}"
        )
    if num_microbatches is None:
        num_microbatches = num_microbatches_from_args(args)
    layers = layers_per_pipeline_rank(args)[pp_rank]
    count = count_params(args, getattr(args, "padded_vocab_size", None))
    return TheoreticalMemory(
        pp_rank=pp_rank,
        parameters=count.on_rank(tp, pp, pp_rank, layers),
        expert_parameters=count.experts_on_rank(layers, pp_rank, pp),
        per_parameter=bytes_per_parameter(args),
        num_microbatches=num_microbatches,
        microbatches_in_flight=microbatches_in_flight(args, num_microbatches, pp_rank),
        activations=dict(
            activations(args, num_microbatches, pp_rank, layers, device_type=device_type)
        ),
        device_type=device_type,
    )


def report_theoretical_memory(
    args,
    num_microbatches: Optional[int] = None,
    pp_rank: int = 0,
    verbose: bool = True,
    print_fn: Callable[[str], None] = print,
    family=None,
    device_type: str = "cuda",
) -> TheoreticalMemory:
    """Print Megatron's theoretical-memory line for pipeline rank ``pp_rank`` (the trainer calls
    it on rank 0, i.e. the first stage, whose activations are the largest), then the breakdown."""
    memory = compute_theoretical_memory(args, num_microbatches, pp_rank, family, device_type)
    print_fn(memory.summary_line())
    if verbose:
        for line in memory.breakdown_lines():
            print_fn(line)
    return memory
