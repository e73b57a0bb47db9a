"""Megatron's checkpoint formats, one layer for the trainer and the offline converters:
:mod:`.layout` (names, tracker, format detection, retention, failed writes), :mod:`.saved_args`
(the stored ``args``), :mod:`.tp_shards` (TP split rules by tensor name), :mod:`.torch_format` and
:mod:`.dist_format` (checkpoints read, and for ``torch`` written, offline as full tensors).

It builds on ``megatron.core.dist_checkpointing`` (Megatron Core's import path: the distributed
layout) and never imports ``megatron.training``.
"""
