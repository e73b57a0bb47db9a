"""megatron-core's ``mamba_stack_spec`` (named by Megatron's hybrid configurations as
``--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec``): the hybrid stack,
whose layers the model builds from its layer pattern. There is one implementation here (plain
PyTorch), so the Transformer Engine and local specs are the same."""

from megatron.core.ssm.mamba_block import MambaStack
from megatron.core.transformer.spec_utils import ModuleSpec

mamba_stack_spec = ModuleSpec(module=MambaStack)
mamba_inference_stack_spec = mamba_stack_spec
