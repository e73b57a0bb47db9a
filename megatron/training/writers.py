"""TensorBoard and Weights & Biases writers, created on the last rank only (Megatron also creates
both on rank world_size - 1 alone)."""

from __future__ import annotations

import os

from .utils import is_last_rank, print_rank_0


def build_tensorboard_writer(args):
    if not args.tensorboard_dir or not is_last_rank():
        return None
    from torch.utils.tensorboard import SummaryWriter

    print_rank_0("> setting tensorboard ...")
    return SummaryWriter(
        log_dir=args.tensorboard_dir,
        max_queue=args.tensorboard_queue_size
        if getattr(args, "tensorboard_queue_size", None)
        else 1000,
    )


class WandbWriter:
    """A thin adapter so the trainer logs scalars the same way to TensorBoard and W&B.

    Unlike upstream Megatron, W&B receives the training metrics whether or not TensorBoard is on.
    """

    def __init__(self, run):
        self.run = run

    def log(self, metrics: dict, step: int):
        self.run.log(metrics, step=step)

    def finish(self):
        self.run.finish()


def build_wandb_writer(args):
    if not getattr(args, "wandb_project", None) or not is_last_rank():
        return None
    if not args.wandb_exp_name:
        raise ValueError("--wandb-exp-name is required when --wandb-project is set")
    import wandb

    save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else "wandb")
    os.makedirs(save_dir, exist_ok=True)
    config = {
        k: (v if isinstance(v, (int, float, str, bool, type(None), list, tuple)) else str(v))
        for k, v in vars(args).items()
    }
    run = wandb.init(
        dir=save_dir,
        name=args.wandb_exp_name,
        project=args.wandb_project,
        entity=getattr(args, "wandb_entity", None) or None,
        config=config,
    )
    return WandbWriter(run)
