"""Megatron's ``MambaStack``: the layers of a hybrid model and its final norm ``final_norm``."""

from megatron.core.transformer.transformer_block import TransformerBlock


class MambaStack(TransformerBlock):
    """A :class:`TransformerBlock` of hybrid layers (Mamba, attention, MLP, MoE: see
    :mod:`.mamba_hybrid_layer_allocation`) whose final norm is named ``final_norm``, as in
    Megatron's ``MambaStack``. Its layers are keyed one by one in a ``torch_dist`` checkpoint
    (:attr:`KEYED_LAYER_BY_LAYER`), as Megatron writes a hybrid stack."""

    KEYED_LAYER_BY_LAYER = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "final_layernorm" in self._modules:
            self.final_norm = self._modules.pop("final_layernorm")

    @property
    def final_layernorm(self):
        return self._modules.get("final_norm")

    @final_layernorm.setter
    def final_layernorm(self, value):
        if value is not None or "final_norm" in self._modules:
            self.final_norm = value
