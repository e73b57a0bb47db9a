"""YaRN rotary embedding (Megatron's ``YarnRotaryEmbedding``, used by multi-latent attention).

YaRN extends a model's context by ``scaling_factor``: the frequencies whose wavelength is long
compared with the original context (``original_max_position_embeddings``) are slowed down by the
factor (interpolation), the short ones are kept (extrapolation), and a linear ramp between the
dimensions where a frequency turns ``beta_fast`` and ``beta_slow`` times over the original
context blends the two. The cos/sin tables are multiplied by the concentration factor
mscale(factor, mscale) / mscale(factor, mscale_all_dim); attention's softmax scale takes
mscale(factor, mscale_all_dim)^2 (see multi_latent_attention.py). Same formulas as Megatron-LM
and Hugging Face's ``_compute_yarn_parameters``; computed here in float64.
"""

import math

import torch

from megatron.core.transformer.rotary_pos_embedding import RotaryEmbedding, RotaryTables


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(scale) + 1 for scale > 1, else 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, max_positions: int) -> float:
    return (dim * math.log(max_positions / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, max_positions: int, round_to_int
):
    """The first and last rotary pair index of the ramp, clamped to [0, dim - 1]."""
    low = _correction_dim(beta_fast, dim, base, max_positions)
    high = _correction_dim(beta_slow, dim, base, max_positions)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


class YarnRotaryEmbedding(RotaryEmbedding):
    """RoPE over ``kv_channels`` dims with YaRN frequencies and the concentration factor folded
    into the cos/sin tables (rotate-half pairs; Megatron's YaRN has no interleaved variant)."""

    def __init__(
        self,
        kv_channels: int,
        rotary_base: float = 10000.0,
        scaling_factor: float = 1.0,
        original_max_position_embeddings: int = 4096,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
        correction_range_round_to_int: bool = True,
    ):
        super().__init__(kv_channels, rotary_base=rotary_base)
        dim = self.dim
        host = torch.device("cpu")  # host: fp64 frequencies, as the parent's inv_freq
        exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=host) / dim
        extrapolated = 1.0 / (rotary_base**exponents)
        interpolated = 1.0 / (scaling_factor * rotary_base**exponents)
        low, high = yarn_correction_range(
            beta_fast,
            beta_slow,
            dim,
            rotary_base,
            original_max_position_embeddings,
            correction_range_round_to_int,
        )
        if low == high:
            high += 0.001  # Megatron's guard against a zero-width ramp
        pairs = torch.arange(dim // 2, dtype=torch.float64, device=host)
        ramp = ((pairs - low) / (high - low)).clamp(0, 1)
        keep = 1.0 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
        self.inv_freq = interpolated * (1 - keep) + extrapolated * keep
        self.concentration = yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(
            scaling_factor, mscale_all_dim
        )

    def get_cos_sin(
        self, seq_len: int, dtype: torch.dtype, device, offset: int = 0
    ) -> RotaryTables:
        key = ("yarn", seq_len, offset, dtype, torch.device(device))
        tables = self._cache.get(key)
        if tables is None:
            angles = self._angles(seq_len, offset)[:, None, None, :]
            tables = (
                (angles.cos() * self.concentration).to(device=device, dtype=dtype),
                (angles.sin() * self.concentration).to(device=device, dtype=dtype),
            )
            if len(self._cache) >= 8:
                self._cache.clear()
            self._cache[key] = tables
        return tables
