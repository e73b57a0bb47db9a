"""Rotary position embedding (RoPE), Megatron's layout and options.

Head dims are rotated in pairs: by default pair i is (x[i], x[i + rot/2]) (GPT-NeoX / Megatron
"rotate half"), with ``rotary_interleaved`` it is (x[2i], x[2i+1]). Pair i turns by the angle
position * base^(-2i/rot). With ``rotary_percent`` < 1 only the first rot = int(d * percent)
dims of a head rotate; the rest pass through. ``rope_scaling`` applies the Llama 3.x frequency
scaling. The model rotates by the token's index in the sequence (0..s-1), not by
``position_ids``; Megatron Core's GPT model does the same.

Angles are computed in float64 and the cos/sin tables cast to the activation dtype; tables are
cached per (length, offset, dtype, device) and are not part of the state dict.
"""

import math
from typing import Optional, Tuple, Union

import torch

RotaryTables = Tuple[torch.Tensor, torch.Tensor]


def llama3_scale_inv_freq(
    inv_freq: torch.Tensor,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> torch.Tensor:
    """Llama 3.x context extension: slow the low frequencies down by ``factor``, keep the high
    ones, and interpolate smoothly between the two wavelength thresholds."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Produces the rotation tables for a sequence length (no parameters)."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: Optional[float] = None,
        rotary_base: float = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        use_cpu_initialization: bool = False,
    ):
        super().__init__()
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(
                f"rotary_percent must be in (0, 1] (--rotary-percent), got {rotary_percent}"
            )
        dim = kv_channels if rotary_percent == 1.0 else int(kv_channels * rotary_percent)
        if dim <= 0 or dim % 2 != 0:
            raise ValueError(
                f"rotary dimension int(kv_channels * rotary_percent) = {dim} "
                "must be a positive even "
                f"number (kv_channels={kv_channels}, --rotary-percent={rotary_percent})"
            )
        if rotary_base <= 0:
            raise ValueError(f"rotary_base must be positive (--rotary-base), got {rotary_base}")
        if seq_len_interpolation_factor is not None and seq_len_interpolation_factor <= 0:
            raise ValueError(
                f"seq_len_interpolation_factor must be positive, got {seq_len_interpolation_factor}"
            )
        self.dim = dim
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        even = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu")  # host: fp64 angles
        inv_freq = 1.0 / (rotary_base ** (even / dim))
        if rope_scaling:
            inv_freq = llama3_scale_inv_freq(inv_freq, factor=rope_scaling_factor)
        # A plain attribute, not a buffer: Megatron checkpoints hold no rotary entries.
        self.inv_freq = inv_freq
        self._cache = {}

    def _angles(self, seq_len: int, offset: int) -> torch.Tensor:
        positions = torch.arange(
            offset, offset + seq_len, dtype=torch.float64, device=self.inv_freq.device
        )
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        return torch.outer(positions, self.inv_freq)  # [s, dim/2]

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """Megatron's angle table ``emb`` of shape [s, 1, 1, dim] (float32)."""
        freqs = self._angles(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).view(max_seq_len, -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.float()[:, None, None, :]

    def get_cos_sin(
        self, seq_len: int, dtype: torch.dtype, device, offset: int = 0
    ) -> RotaryTables:
        """(cos, sin) of the per-pair angles, each [s, 1, 1, dim/2], cached."""
        key = (seq_len, offset, dtype, torch.device(device))
        tables = self._cache.get(key)
        if tables is None:
            angles = self._angles(seq_len, offset)[:, None, None, :]
            tables = (
                angles.cos().to(device=device, dtype=dtype),
                angles.sin().to(device=device, dtype=dtype),
            )
            if len(self._cache) >= 8:
                self._cache.clear()
            self._cache[key] = tables
        return tables


def tables_from_emb(emb: torch.Tensor, interleaved: bool, dtype: torch.dtype) -> RotaryTables:
    """(cos, sin) half tables from a Megatron angle table ``emb`` [s, 1, 1, dim]."""
    half = emb[..., 0::2] if interleaved else emb[..., : emb.shape[-1] // 2]
    return half.cos().to(dtype), half.sin().to(dtype)


def apply_rotary_pos_emb(
    t: torch.Tensor, rotary: Union[RotaryTables, torch.Tensor], interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first ``rot`` dims of the heads of ``t`` [s, b, ..., d].

    ``rotary`` is a (cos, sin) pair from :meth:`RotaryEmbedding.get_cos_sin` (or a Megatron angle
    table); tables of shape [s, 1, 1, rot/2] broadcast over any number of head dimensions.
    """
    if isinstance(rotary, torch.Tensor):
        rotary = tables_from_emb(rotary, interleaved, t.dtype)
    cos, sin = rotary
    if cos.dtype != t.dtype or cos.device != t.device:
        cos, sin = cos.to(t), sin.to(t)
    half = cos.shape[-1]
    extra = t.dim() - cos.dim()
    if extra > 0:  # e.g. queries viewed as [s, b, groups, heads_per_group, d]
        cos = cos.view(cos.shape[:-1] + (1,) * extra + cos.shape[-1:])
        sin = sin.view(sin.shape[:-1] + (1,) * extra + sin.shape[-1:])
    rot = 2 * half
    if interleaved:
        x1, x2 = t[..., 0:rot:2], t[..., 1:rot:2]
    else:
        x1, x2 = t[..., :half], t[..., half:rot]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    if interleaved:
        rotated = torch.stack((out1, out2), dim=-1).flatten(-2)
        if rot == t.shape[-1]:
            return rotated
        return torch.cat((rotated, t[..., rot:]), dim=-1)
    if rot == t.shape[-1]:
        return torch.cat((out1, out2), dim=-1)
    return torch.cat((out1, out2, t[..., rot:]), dim=-1)
