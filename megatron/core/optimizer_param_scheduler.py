"""Learning-rate and weight-decay schedule (Megatron's OptimizerParamScheduler).

All step counts are in *samples*: the trainer calls step(increment) after every successful
iteration with the number of samples that iteration consumed.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, Optional

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    """Sets every param group's 'lr' and 'weight_decay' from the number of samples seen."""

    def __init__(
        self,
        optimizer,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool = True,
        override_opt_param_scheduler: bool = False,
        wsd_decay_steps: Optional[int] = None,
        lr_wsd_decay_style: Optional[str] = None,
    ):
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self._validate()
        self.step(0)

    def _validate(self) -> None:
        if self.min_lr < 0.0:
            raise ValueError(f"minimum learning rate (--min-lr) must be >= 0, got {self.min_lr}")
        if self.max_lr < self.min_lr:
            raise ValueError(
                f"learning rate (--lr {self.max_lr}) must be >= minimum learning rate "
                f"(--min-lr {self.min_lr})"
            )
        if self.init_lr > self.max_lr:
            raise ValueError(
                f"warmup initial learning rate (--lr-warmup-init {self.init_lr}) must be <= "
                f"learning rate (--lr {self.max_lr})"
            )
        if not self.lr_decay_steps > 0:
            raise ValueError(
                f"learning-rate decay steps (--lr-decay-iters/--lr-decay-samples) must be > 0, "
                f"got {self.lr_decay_steps}"
            )
        if self.lr_warmup_steps < 0:
            raise ValueError(f"learning-rate warmup steps must be >= 0, got {self.lr_warmup_steps}")
        if not self.lr_warmup_steps < self.lr_decay_steps:
            raise ValueError(
                f"learning-rate warmup steps ({self.lr_warmup_steps}) must be smaller than "
                "the decay "
                f"steps ({self.lr_decay_steps}); check --lr-warmup-iters/--lr-warmup-samples/"
                "--lr-warmup-fraction against --lr-decay-iters/--lr-decay-samples"
            )
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(
                f"--lr-decay-style must be one of {list(LR_DECAY_STYLES)}, "
                f"got {self.lr_decay_style!r}"
            )
        if self.lr_decay_style == "WSD":
            if self.wsd_decay_steps is None:
                raise ValueError(
                    "--lr-decay-style WSD needs --lr-wsd-decay-iters/--lr-wsd-decay-samples"
                )
            if self.wsd_decay_steps < 0:
                raise ValueError(f"WSD decay steps must be >= 0, got {self.wsd_decay_steps}")
            if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
                raise ValueError(
                    f"--lr-wsd-decay-style must be one of {list(WSD_DECAY_STYLES)}, "
                    f"got {self.lr_wsd_decay_style!r}"
                )
        if self.start_wd < 0.0:
            raise ValueError(
                f"start weight decay (--start-weight-decay) must be >= 0, got {self.start_wd}"
            )
        if self.end_wd < self.start_wd:
            raise ValueError(
                f"end weight decay (--end-weight-decay {self.end_wd}) must be >= "
                "start weight decay "
                f"(--start-weight-decay {self.start_wd})"
            )
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(
                f"--weight-decay-incr-style must be one of {list(WD_INCR_STYLES)}, "
                f"got {self.wd_incr_style!r}"
            )
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(
                f"constant weight decay needs --start-weight-decay ({self.start_wd}) == "
                f"--end-weight-decay ({self.end_wd})"
            )
        if self.wd_incr_style != "constant" and not self.wd_incr_steps > 0:
            raise ValueError(f"weight-decay increment steps must be > 0, got {self.wd_incr_steps}")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler "
                "are both set"
            )

    # ------------------------------------------------------------------ schedules
    def get_wd(self) -> float:
        if self.num_steps > self.wd_incr_steps:
            return self.end_wd
        if self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        delta = self.end_wd - self.start_wd
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * delta

    def get_lr(self, param_group: Dict[str, Any]) -> float:
        """LR for `param_group` (its 'max_lr'/'min_lr' override the scheduler's) before lr_mult."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)

        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(self.num_steps) / float(
                self.lr_warmup_steps
            )
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1)
            steps = max(self.num_steps, 1)
            return max(min_lr, max_lr * warmup**0.5 / steps**0.5)

        ratio = float(self.num_steps - self.lr_warmup_steps) / float(
            self.lr_decay_steps - self.lr_warmup_steps
        )
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: hold max_lr, then anneal over the last wsd_decay_steps
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= anneal_start:
                coeff = 1.0
            else:
                q = float(self.num_steps - anneal_start) / float(self.wsd_decay_steps)
                if self.lr_wsd_decay_style == "linear":
                    coeff = 1.0 - q
                elif self.lr_wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * q) + 1.0)
                elif self.lr_wsd_decay_style == "exponential":
                    coeff = 2.0 * math.pow(0.5, q) - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(q)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        """Advance by `increment` samples and set every group's 'lr' and 'weight_decay'."""
        self.num_steps += increment
        new_wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = new_wd * group.get("wd_mult", 1.0)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Dict[str, Any]:
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value, sd_value, name: str):
        """Resolve a value given both on the command line and in the checkpoint."""
        if self.override_opt_param_scheduler:
            logger.info(" > overriding %s value to %s", name, cls_value)
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(
                f"OptimizerParamScheduler: {name} is {cls_value} on the command line "
                f"but {sd_value} "
                "in the checkpoint; pass --use-checkpoint-opt-param-scheduler "
                "to take the checkpoint "
                "value or --override-opt-param-scheduler to take the command-line value"
            )
        logger.info(" > using checkpoint value %s for %s", sd_value, name)
        return sd_value

    @staticmethod
    def _first_key(state_dict: Dict[str, Any], *keys: str):
        for key in keys:
            if key in state_dict:
                return state_dict[key]
        raise ValueError(f"scheduler checkpoint has none of the keys {list(keys)}")

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore progress; older key names (start_lr, warmup_iter, end_iter, ...) are accepted."""
        old_max_lr, old_min_lr = self.max_lr, self.min_lr
        self.max_lr = float(
            self._check_and_set(
                self.max_lr, self._first_key(state_dict, "start_lr", "max_lr"), "learning rate"
            )
        )
        self.min_lr = float(
            self._check_and_set(
                self.min_lr, self._first_key(state_dict, "min_lr"), "minimum learning rate"
            )
        )
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps,
            self._first_key(state_dict, "warmup_iter", "warmup_steps", "lr_warmup_steps"),
            "warmup iterations",
        )
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps,
            self._first_key(state_dict, "end_iter", "decay_steps", "lr_decay_steps"),
            "total number of iterations",
        )
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style,
            self._first_key(state_dict, "decay_style", "lr_decay_style"),
            "learning rate decay style",
        )
        if "start_wd" in state_dict:
            self.start_wd = float(
                self._check_and_set(self.start_wd, state_dict["start_wd"], "start weight decay")
            )
            self.end_wd = float(
                self._check_and_set(self.end_wd, state_dict["end_wd"], "end weight decay")
            )
            self.wd_incr_steps = self._check_and_set(
                self.wd_incr_steps,
                state_dict["wd_incr_steps"],
                "total number of weight decay iterations",
            )
            self.wd_incr_style = self._check_and_set(
                self.wd_incr_style, state_dict["wd_incr_style"], "weight decay incr style"
            )
        self._validate()

        # Groups built from the command line carry max_lr/min_lr; keep the non-decoupled ones in
        # step with the scheduler's resolved values so --use-checkpoint-opt-param-scheduler works.
        for group in self.optimizer.param_groups:
            if group.get("is_decoupled_lr", False):
                continue
            if "max_lr" in group and group["max_lr"] == old_max_lr:
                group["max_lr"] = self.max_lr
            if "min_lr" in group and group["min_lr"] == old_min_lr:
                group["min_lr"] = self.min_lr

        self.num_steps = 0
        self.step(int(self._first_key(state_dict, "num_iters", "num_steps")))
