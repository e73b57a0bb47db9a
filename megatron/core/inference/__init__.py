"""Text generation: a KV cache, sampling and the batched generation loop."""

from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.generation import (
    GenerationResult,
    SamplingParams,
    SpecialTokens,
    generate,
)
from megatron.core.inference.model_forward import InferenceModelForward

__all__ = [
    "GenerationResult",
    "InferenceModelForward",
    "SamplingParams",
    "SpecialTokens",
    "StaticInferenceContext",
    "generate",
]
