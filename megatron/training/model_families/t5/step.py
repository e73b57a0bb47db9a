"""T5's batch and forward step (span corruption; the loss is GPT's masked token loss)."""

from functools import partial

from megatron.core.device import compute_device
from megatron.training import get_timers
from megatron.training.model_families.losses import masked_token_loss


def get_batch(data_iterator):
    """(encoder ids, decoder ids, loss mask, labels, encoder mask, decoder mask). Labels are -1
    after the decoder's end (Megatron's convention); they become 0 there, where the loss mask
    is 0, so that every label is a vocabulary row."""
    batch = next(data_iterator)
    device = compute_device()
    return (
        batch["text_enc"].long().to(device),
        batch["text_dec"].long().to(device),
        batch["loss_mask"].float().to(device),
        batch["labels"].long().to(device).clamp(min=0),
        batch["enc_mask"].long().to(device),
        batch["dec_mask"].long().to(device),
    )


def forward_step(data_iterator, model):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens_enc, tokens_dec, loss_mask, labels, enc_mask, dec_mask = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens_enc, tokens_dec, enc_mask, dec_mask, lm_labels=labels)
    return output_tensor, partial(masked_token_loss, loss_mask)
