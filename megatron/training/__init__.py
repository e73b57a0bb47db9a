"""The command-line side: arguments, initialization, the training loop, checkpoints, logging."""

from .global_vars import (  # noqa: F401
    get_args,
    get_current_global_batch_size,
    get_num_microbatches,
    get_parallel_state,
    get_tensorboard_writer,
    get_timers,
    get_tokenizer,
    get_wandb_writer,
)
from .utils import print_rank_0, print_rank_last  # noqa: F401


def pretrain(*args, **kwargs):
    """See :func:`megatron.training.training.pretrain` (imported lazily to keep imports light)."""
    from .training import pretrain as _pretrain

    return _pretrain(*args, **kwargs)
