"""Loss (gradient) scalers for mixed-precision training.

The scale is kept as a one-element float32 tensor (Megatron keeps it as a tensor too, so that
``loss * scale`` stays on the device without a host round trip).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from megatron.core.device import compute_device


class MegatronGradScaler:
    """Base class: holds the current scale and knows how to react to an overflow."""

    def __init__(self, initial_scale: float, device: Optional[torch.device | str] = None):
        """``device``: where the loss it scales is (default: the compute device)."""
        if not initial_scale > 0.0:
            raise ValueError(f"loss scale must be positive, got {initial_scale}")
        device = compute_device() if device is None else device
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        raise NotImplementedError


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (``--loss-scale``); overflowing steps are still skipped."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Dynamic loss scale with hysteresis (Megatron semantics).

    * Every overflow resets the growth counter and decrements the hysteresis counter; once the
      hysteresis counter reaches zero, each overflow multiplies the scale by ``backoff_factor``
      (never below ``min_scale``). The hysteresis counter is *not* refilled by a backoff, so
      after the first backoff every further overflow backs off again until the scale grows.
    * After ``growth_interval`` consecutive clean steps the scale is multiplied by
      ``growth_factor`` and the hysteresis counter is refilled.
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        device: Optional[torch.device | str] = None,
    ):
        super().__init__(initial_scale, device=device)
        device = self._scale.device
        if not min_scale > 0.0:
            raise ValueError(f"min loss scale (--min-loss-scale) must be positive, got {min_scale}")
        if min_scale > initial_scale:
            raise ValueError(
                f"min loss scale (--min-loss-scale {min_scale}) is larger than the initial loss "
                f"scale (--initial-loss-scale {initial_scale})"
            )
        if not growth_factor > 1.0:
            raise ValueError(f"growth factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff factor must be in (0, 1), got {backoff_factor}")
        if not growth_interval > 0:
            raise ValueError(
                f"loss scale window (--loss-scale-window) must be > 0, got {growth_interval}"
            )
        if not hysteresis >= 1:
            raise ValueError(f"hysteresis (--hysteresis) must be >= 1, got {hysteresis}")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32, device=device)
        self.growth_factor = torch.tensor(
            [float(growth_factor)], dtype=torch.float32, device=device
        )
        self.backoff_factor = torch.tensor(
            [float(backoff_factor)], dtype=torch.float32, device=device
        )
        self.growth_interval = growth_interval
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> Dict[str, Any]:
        return {
            "scale": self._scale.detach().clone(),
            "growth_tracker": int(self._growth_tracker),
            "hysteresis_tracker": int(self._hysteresis_tracker),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state_dict)
        if missing:
            raise ValueError(f"grad scaler state dict lacks {sorted(missing)}")
        scale = torch.as_tensor(state_dict["scale"], dtype=torch.float32, device=self._scale.device)
        self._scale = scale.reshape(1).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
