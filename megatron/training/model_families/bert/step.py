"""BERT's batch, loss and forward step (masked LM + sentence order)."""

from functools import partial

import torch
import torch.nn.functional as F

from megatron.core.device import compute_device
from megatron.training import get_args, get_timers
from megatron.training.rerun import check_loss


def get_batch(data_iterator):
    """(tokens, types, sentence order, loss mask, labels, padding mask) of the next micro-batch.

    Labels are -1 where nothing is masked (Megatron's convention); they are set to 0 there so
    that every label is a vocabulary row; the loss mask removes those positions."""
    batch = next(data_iterator)
    device = compute_device()
    tokens = batch["text"].long().to(device)
    types = batch["types"].long().to(device)
    sentence_order = batch["is_random"].long().to(device)
    loss_mask = batch["loss_mask"].float().to(device)
    labels = batch["labels"].long().to(device).clamp(min=0)
    padding_mask = batch["padding_mask"].long().to(device)
    return tokens, types, sentence_order, loss_mask, labels, padding_mask


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor):
    """Masked-LM loss averaged over the masked tokens of the micro-batch, plus the
    sentence-order cross entropy with the binary head; reported as 'lm loss' and 'sop loss'.

    A micro-batch without a masked token (possible with very short samples) contributes 0
    instead of Megatron's 0/0."""
    args = get_args()
    lm_losses, sop_logits = output_tensor
    loss_mask = loss_mask.float().reshape(-1)
    lm_loss = torch.sum(lm_losses.float().reshape(-1) * loss_mask) / loss_mask.sum().clamp(min=1)
    loss = lm_loss
    reported = {"lm loss": lm_loss.clone().detach()}
    if sop_logits is not None:
        sop_loss = F.cross_entropy(
            sop_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1
        )
        loss = lm_loss + sop_loss
        reported["sop loss"] = sop_loss.clone().detach()
    check_loss(loss, args)
    return loss, reported


def forward_step(data_iterator, model):
    args = get_args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, types, sentence_order, loss_mask, labels, padding_mask = get_batch(data_iterator)
    timers("batch-generator").stop()
    if not args.bert_binary_head:
        types = None
    output_tensor = model(tokens, padding_mask, tokentype_ids=types, lm_labels=labels)
    return output_tensor, partial(loss_func, loss_mask, sentence_order)
