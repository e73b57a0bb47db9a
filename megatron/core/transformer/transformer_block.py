"""A stack of transformer layers plus the final norm; one pipeline stage's slice of the model."""

from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from megatron.core.device import compute_device
from megatron.core.pipeline_parallel.layer_split import (
    get_num_layers_to_build,
    get_transformer_layer_offset,
)
from megatron.core.tensor_parallel.process_groups import resolve_pg_collection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.cuda_graphs import layer_graphs_for
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import (
    SlotSpec,
    TransformerLayer,
    TransformerLayerSubmodules,
)
from megatron.core.transformer.utils import init_rng_scope, recompute


@dataclass
class TransformerBlockSubmodules:
    """Layer specs that may differ per layer (e.g. an MoE layer every other layer).

    ``layer_specs`` holds one spec per layer of the whole model (the block takes its pipeline
    stage's slice) or exactly one per layer of this block (Megatron's per-stage lists).
    """

    layer_specs: List[ModuleSpec]
    """Layer specs (of the model or of this block), in layer order."""
    layer_norm: SlotSpec = None
    """The final norm of the last stage; None: no final norm."""


def plain_layer_spec() -> ModuleSpec:
    """The layer a block builds when given no spec: norm, self-attention (causal), norm, MLP."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=SelfAttention,
            pre_mlp_layernorm=build_norm,
            mlp=MLP,
        ),
    )


class TransformerBlock(MegatronModule):
    """``layers`` (a ModuleList, indexed locally from 0: Megatron's state dicts also number a
    stage's layers from 0) and, when
    this block ends the model (``post_process`` and ``post_layer_norm``), ``final_layernorm``.

    ``spec`` is one layer spec for every layer, or a :class:`TransformerBlockSubmodules`; None
    means :func:`plain_layer_spec` with a final norm. The layers of this pipeline stage and
    virtual stage (``vp_stage``) come from the config's pipeline split and the pipeline rank of
    ``pg_collection`` (:func:`get_num_layers_to_build`, :func:`get_transformer_layer_offset`);
    ``num_layers`` (and ``layer_number_offset``, default 0) override them for a chunk built by
    hand. Each layer knows its global 1-based ``layer_number``. A stage without the embedding
    (``pre_process=False``) reads its input from :meth:`set_input_tensor`.
    """

    def __init__(
        self,
        config,
        spec: Union[ModuleSpec, TransformerBlockSubmodules, None] = None,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection=None,
        vp_stage: Optional[int] = None,
        *,
        num_layers: Optional[int] = None,
        layer_number_offset: Optional[int] = None,
    ):
        super().__init__(config)
        pgs = resolve_pg_collection(config, pg_collection)
        if num_layers is None:
            pp_rank = pgs.pp_rank if pgs.pp is not None else None
            num_layers = get_num_layers_to_build(config, vp_stage, pp_rank)
            if layer_number_offset is None:
                layer_number_offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        elif layer_number_offset is None:
            layer_number_offset = 0  # a chunk built by hand starts at the first layer
        if num_layers < 0 or layer_number_offset < 0:
            raise ValueError(
                f"num_layers ({num_layers}) and layer_number_offset ({layer_number_offset}) "
                "must be >= 0"
            )
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.vp_stage = vp_stage
        self.num_layers_per_pipeline_rank = num_layers
        self.layer_number_offset = layer_number_offset
        layer_specs, final_norm = _layer_specs(
            spec, config.num_layers, layer_number_offset, num_layers
        )
        layers = []
        for i, layer_spec in enumerate(layer_specs):
            number = layer_number_offset + i + 1
            with init_rng_scope(config.init_seed, number):
                layers.append(
                    build_module(
                        layer_spec, config=config, layer_number=number, pg_collection=pg_collection
                    )
                )
        self.layers = torch.nn.ModuleList(layers)
        if post_process and post_layer_norm and final_norm is not None:
            self.final_layernorm = build_module(
                final_norm,
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )
        else:
            self.final_layernorm = None
        self.input_tensor = None
        self.tp_group = pgs.tp
        # cuda_graph_impl='local': each layer is called through its graph runner.
        self.layer_graphs = layer_graphs_for(config, self.layers)

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """The activation received from the previous pipeline stage (used when not pre_process)."""
        self.input_tensor = input_tensor

    # ------------------------------------------------------------------------------ MoE
    def _moe_routers(self) -> Iterator[Tuple[int, TopKRouter]]:
        """(global 1-based layer number, router) of this block's MoE layers."""
        for layer in self.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if isinstance(router, TopKRouter):
                yield layer.layer_number, router

    def set_moe_aux_loss_scale(self, scale) -> None:
        for _, router in self._moe_routers():
            router.aux_loss_scale = scale

    def moe_metrics(self, names: Sequence[str], num_layers: int) -> torch.Tensor:
        """[len(names), num_layers] float32: what each router of this block tracked under each
        name (this step's sum, this rank's part) at its layer number - 1; 0 elsewhere."""
        values = torch.zeros(len(names), num_layers, dtype=torch.float32, device=compute_device())
        for number, router in self._moe_routers():
            for i, name in enumerate(names):
                if name in router.tracked:
                    values[i, number - 1] = router.tracked[name].to(values.device)
        return values

    def reset_moe_metrics(self) -> None:
        """Start the next step's sums."""
        for _, router in self._moe_routers():
            router.tracked.clear()

    def _checkpointed(self, start: int, end: int):
        def run(hidden_states, attention_mask, context, context_mask, rotary_pos_emb):
            for layer in self.layers[start:end]:
                hidden_states, context = layer(
                    hidden_states,
                    attention_mask=attention_mask,
                    context=context,
                    context_mask=context_mask,
                    rotary_pos_emb=rotary_pos_emb,
                )
            return hidden_states

        return run

    def forward(
        self,
        hidden_states: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb=None,
        inference_context=None,
        **kwargs,
    ) -> torch.Tensor:
        """[s, b, h] -> [s, b, h]. ``hidden_states`` is ignored when not ``pre_process``.
        ``context`` / ``context_mask``: the encoder output and its mask, for layers with
        cross-attention. ``inference_context``: the KV cache during generation."""
        if not self.pre_process:
            if self.input_tensor is None:
                raise ValueError(
                    "TransformerBlock without pre_process needs set_input_tensor() before forward"
                )
            hidden_states = self.input_tensor
        config = self.config
        if config.recompute_granularity == "full" and self.training:
            if inference_context is not None:
                raise ValueError("the KV cache (inference_context) is for inference, not training")
            hidden_states = self._forward_full_recompute(
                hidden_states, attention_mask, context, context_mask, rotary_pos_emb
            )
        else:
            # Passed only when set, so layer modules without a KV cache keep working.
            cache = {} if inference_context is None else {"inference_context": inference_context}
            graphs = self.layer_graphs
            for layer in self.layers if graphs is None else graphs.runners:
                hidden_states, context = layer(
                    hidden_states,
                    attention_mask=attention_mask,
                    context=context,
                    context_mask=context_mask,
                    rotary_pos_emb=rotary_pos_emb,
                    **cache,
                )
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states

    def _forward_full_recompute(
        self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb
    ):
        n = len(self.layers)
        k = self.config.recompute_num_layers
        # With --distribute-saved-activations each TP rank keeps 1/TP of every chunk input.
        distribute = bool(self.config.distribute_saved_activations)
        if self.config.recompute_method == "uniform":
            # Only the input of each chunk of k layers is kept; the chunk reruns in backward.
            for start in range(0, n, k):
                hidden_states = recompute(
                    self.config,
                    self._checkpointed(start, min(start + k, n)),
                    hidden_states,
                    attention_mask,
                    context,
                    context_mask,
                    rotary_pos_emb,
                    tp_group=self.tp_group,
                    distribute_saved_activations=distribute,
                )
            return hidden_states
        for i, layer in enumerate(self.layers):  # 'block': the first k layers of this stage
            if i < k:
                hidden_states = recompute(
                    self.config,
                    self._checkpointed(i, i + 1),
                    hidden_states,
                    attention_mask,
                    context,
                    context_mask,
                    rotary_pos_emb,
                    tp_group=self.tp_group,
                    distribute_saved_activations=distribute,
                )
            else:
                hidden_states, context = layer(
                    hidden_states,
                    attention_mask=attention_mask,
                    context=context,
                    context_mask=context_mask,
                    rotary_pos_emb=rotary_pos_emb,
                )
        return hidden_states


def _layer_specs(spec, total_layers: int, offset: int, count: int):
    """(this block's layer specs, final norm spec) from what the block was given."""
    if spec is None:
        return [plain_layer_spec()] * count, build_norm
    if not isinstance(spec, TransformerBlockSubmodules):
        return [spec] * count, build_norm
    specs = list(spec.layer_specs)
    if len(specs) == total_layers:
        # One per layer of the model: this stage's slice (also when the block is the model).
        specs = specs[offset : offset + count]
    elif len(specs) != count:
        raise ValueError(
            f"TransformerBlockSubmodules has {len(specs)} layer specs; expected one per layer of "
            f"the model ({total_layers}) or of this pipeline stage ({count})"
        )
    return specs, spec.layer_norm
