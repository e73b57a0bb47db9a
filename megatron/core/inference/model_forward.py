"""One generation step of a (tensor- and pipeline-) parallel GPT model: tokens in, full-vocab
logits out on the last pipeline stage.

With pipeline parallelism every stage runs the step: the first embeds the tokens, each stage
sends its hidden states [s, b, h] to the next (point-to-point over the pipeline group) and the
last computes the logits; the other stages return None. Under tensor parallelism the logits are
gathered over the vocabulary shards, so every rank of the last stage holds the same full logits.
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region


class InferenceModelForward:
    """Callable ``(tokens [b, s], position_ids [b, s], inference_context) -> logits`` [b, s, V]
    (``vocab_size`` columns: the padding rows of the embedding are dropped) on the last stage,
    None on the others. The caller advances the context after the call.

    ``model``: this rank's model chunk (a GPTModel, possibly wrapped, e.g. in a Float16Module);
    ``pp_group`` / ``tp_group``: the process groups (None: one stage / no tensor parallelism);
    ``hidden_size`` and ``dtype``: of the activations passed between stages.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        pp_group=None,
        tp_group=None,
    ):
        self.model = model
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.pp_group = pp_group
        self.tp_group = tp_group
        pp_size = 1 if pp_group is None else dist.get_world_size(pp_group)
        self.pp_rank = 0 if pp_group is None else dist.get_rank(pp_group)
        self.pp_size = pp_size
        self.is_first_stage = self.pp_rank == 0
        self.is_last_stage = self.pp_rank == pp_size - 1
        self.last_stage_rank = (
            None if pp_group is None else dist.get_global_rank(pp_group, pp_size - 1)
        )
        self._chunk = _unwrap(model)

    def _neighbour(self, step: int) -> int:
        return dist.get_global_rank(self.pp_group, self.pp_rank + step)

    def __call__(
        self, tokens: torch.Tensor, position_ids: torch.Tensor, inference_context
    ) -> Optional[torch.Tensor]:
        b, s = tokens.shape
        if not self.is_first_stage:
            received = torch.empty(s, b, self.hidden_size, dtype=self.dtype, device=tokens.device)
            dist.recv(received, src=self._neighbour(-1), group=self.pp_group)
            self._chunk.set_input_tensor(received)
        output = self.model(tokens, position_ids, None, inference_context=inference_context)
        if not self.is_last_stage:
            dist.send(
                output.to(self.dtype).contiguous(), dst=self._neighbour(1), group=self.pp_group
            )
            return None
        # Under TP the logits are this rank's vocab shard unless the model gathered them.
        tp_size = 1 if self.tp_group is None else dist.get_world_size(self.tp_group)
        if tp_size > 1 and getattr(self._chunk, "parallel_output", True):
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        return output[..., : self.vocab_size].float()


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside wrappers that keep it as ``.module`` (Float16Module, DDP)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model
