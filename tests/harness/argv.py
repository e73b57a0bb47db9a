"""Command lines for the Megatron argument parser (pretrain_gpt.py, dry_run, validate_args),
built in one place: a flag that becomes required, or is renamed, is fixed here once.

A command line is a base (a dict of dest -> value) with the test's own flags over it. Each test
states, as keywords, the values it relies on, even where they equal the base's: the base only
makes the command line valid.
"""

# GPT on mock data needs no file: --mock-data and the NullTokenizer (which takes --vocab-size).
MOCK_DATA = {"mock_data": True, "tokenizer_type": "NullTokenizer"}

# A small model that passes every rule of validate_args and uses no unimplemented feature.
TINY = {
    "num_layers": "4",
    "hidden_size": "64",
    "num_attention_heads": "4",
    "max_position_embeddings": "256",
    "seq_length": "128",
    "micro_batch_size": "2",
    "train_iters": "10",
    "lr": "1e-3",
    **MOCK_DATA,
    "vocab_size": "128",
}

# A short training run of pretrain_gpt.py (tests/functional_tests/runner.py's TINY_MODEL): a
# learning-rate schedule, dropout, a log line every iteration, no evaluation and the torch
# checkpoint format. It gives no --train-iters: each run states its own.
TINY_RUN = {
    "num_layers": "2",
    "hidden_size": "64",
    "num_attention_heads": "4",
    "seq_length": "32",
    "max_position_embeddings": "32",
    "micro_batch_size": "2",
    "global_batch_size": "8",
    "lr": "5e-3",
    "min_lr": "5e-4",
    "lr_decay_style": "cosine",
    "lr_warmup_iters": "2",
    **MOCK_DATA,
    "vocab_size": "500",
    "num_workers": "0",
    "log_interval": "1",
    "eval_iters": "0",
    "ckpt_format": "torch",
    "hidden_dropout": "0.1",
    "attention_dropout": "0.1",
    "seed": "1234",
}


def option(dest):
    """The command-line spelling of ``dest`` (``num_layers`` -> ``--num-layers``)."""
    return "--" + dest.replace("_", "-")


def megatron_argv(*extra, base=TINY, **flags):
    """``base`` with ``flags`` over it, as a command line, then ``extra``.

    A flag keeps its place in ``base`` when given a new value; new flags follow in the order
    given. ``True`` gives a switch (``--mock-data``), ``None`` or ``False`` leaves the flag out
    (``mock_data=None`` with ``data_path=...`` trains on files); anything else is written with
    ``str``. ``extra`` (strings, or values made strings) is for what a dest cannot spell, such
    as ``--use-checkpoint-opt_param-scheduler``, or for flags that must come last.
    """
    merged = {**(base or {}), **flags}
    argv = []
    for dest, value in merged.items():
        if value is None or value is False:
            continue
        argv += [option(dest)] if value is True else [option(dest), str(value)]
    return argv + [str(a) for a in extra]
