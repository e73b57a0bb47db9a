"""GPT's batch and forward step (Megatron's ``get_batch`` and ``forward_step``)."""

from functools import partial

from megatron.core.device import compute_device
from megatron.core.transformer.context_parallel import get_batch_on_this_cp_rank
from megatron.training import get_args, get_parallel_state, get_timers, get_tokenizer
from megatron.training.flag_errors import UserInputError
from megatron.training.model_families.losses import masked_token_loss


def _check_token_ids(batch, args) -> None:
    """Data tokenized with a larger vocabulary than this run's would index past the embedding
    (one process) or be masked away in silence (tensor parallel): refuse it by name."""
    vocab_size = get_tokenizer().vocab_size
    for key in ("tokens", "labels"):
        largest = int(batch[key].max()) if batch[key].numel() else 0
        if largest >= vocab_size:
            names = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
            paths = [p for name in names for p in (getattr(args, name, None) or [])]
            raise UserInputError(
                f"token id {largest} in the data ({' '.join(paths) or 'mock data'}) is outside "
                "the vocabulary of "
                f"--tokenizer-type {args.tokenizer_type} (ids 0..{vocab_size - 1}); the data was "
                "tokenized with another vocabulary (re-run tools/preprocess_data.py with this "
                "run's tokenizer)"
            )


def get_batch(data_iterator):
    """The next micro-batch on this rank's device, cut to this rank's context-parallel chunks.

    Every tensor-parallel rank reads the same data-parallel batch from its own loader, so no
    broadcast over TP is needed. The causal mask is implicit unless documents must not attend
    to each other (--reset-attention-mask), which keeps the fast SDPA path."""
    args = get_args()
    batch = next(data_iterator)
    _check_token_ids(batch, args)
    device = compute_device()
    tokens = batch["tokens"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    attention_mask = None
    if args.reset_attention_mask and "attention_mask" in batch:
        attention_mask = batch["attention_mask"].to(device, non_blocking=True)
    state = get_parallel_state()
    if state.get_context_parallel_world_size() > 1:
        cut = get_batch_on_this_cp_rank(
            {
                "tokens": tokens,
                "labels": labels,
                "loss_mask": loss_mask,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
            },
            state.get_context_parallel_world_size(),
            state.get_context_parallel_rank(),
        )
        return (
            cut["tokens"],
            cut["labels"],
            cut["loss_mask"],
            cut["attention_mask"],
            cut["position_ids"],
        )
    return tokens, labels, loss_mask, attention_mask, position_ids


def forward_step(data_iterator, model):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(masked_token_loss, loss_mask)
