"""No host synchronisation per micro-batch beyond Megatron's, and the reported losses read on the
host only at the log interval (issue #33).

A CPU has no device to wait for, so the test records the operations that would wait for one on a
GPU: reading a tensor's value on the host (``aten._local_scalar_dense``: ``.item()``, ``bool()``,
``int()``, ``float()``), ``.tolist()``, ``.cpu()``, ``.numpy()``, and the operations whose output
size depends on the data (``nonzero``, ``masked_select``, indexing with a boolean mask). Each is
attributed to the innermost function of the repository that called it. One training (a tiny MoE
GPT in fp16, so that the auxiliary losses take the dynamic loss scale in backward) runs with 1
and with 4 micro-batches per iteration: only Megatron's own per-micro-batch reads may grow with
the micro-batch count, and the log path (loss reduction, MoE losses, the log line) reads nothing
at an iteration that prints nothing.
"""

import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.functional_tests.runner import REPO, TINY_MODEL

aten = torch.ops.aten

# (file, function) -> why a read there per micro-batch is allowed.
PER_MICROBATCH_ALLOWED = {
    ("megatron/core/transformer/moe/token_dispatcher.py", "_sorted_by_expert"): (
        "the tokens per expert as split sizes on the host: Megatron's dispatchers read them too"
    ),
    ("megatron/training/model_families/gpt/step.py", "_check_token_ids"): (
        "the token ids of the data loader's batch, a host tensor, before its copy to the device"
    ),
}
# The log path: what it reads must wait for an iteration that prints or writes.
LOG_PATH = {
    ("megatron/training/training.py", "_reduce_losses"),
    ("megatron/training/training.py", "train_step"),
    ("megatron/training/moe_logging.py", "moe_loss_scalars"),
    ("megatron/training/moe_logging.py", "collect_moe_losses"),
}
LOG_PATH_FILES = ("megatron/training/training_log.py",)

FLAGS = TINY_MODEL + [
    "--train-iters",
    "2",
    "--lr-warmup-iters",
    "1",
    "--log-interval",
    "2",  # iteration 1 prints nothing, iteration 2 prints the line
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "48",
    "--moe-aux-loss-coeff",
    "0.01",
    "--moe-z-loss-coeff",
    "0.001",
    "--fp16",
    "--initial-loss-scale",
    "4096",
]


def _caller() -> tuple:
    """(file relative to the repository, function) of the innermost repository frame outside
    the tests and outside installed packages (a virtual environment may live in the checkout)."""
    repo = str(REPO) + "/"
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        ours = name.startswith(repo) and "/site-packages/" not in name
        if ours and not name.startswith(repo + "tests/"):
            return name[len(repo) :], frame.f_code.co_name
        frame = frame.f_back
    return "<outside the repository>", ""


class HostReads(TorchDispatchMode):
    """Counts host reads per (iteration, what, caller) while ``iteration`` is set."""

    DATA_DEPENDENT = {aten._local_scalar_dense.default, aten.nonzero.default}
    DATA_DEPENDENT |= {aten.masked_select.default}

    def __init__(self):
        super().__init__()
        self.iteration = None
        self.counts = collections.defaultdict(collections.Counter)

    def note(self, what):
        if self.iteration is not None:
            self.counts[self.iteration][(what, *_caller())] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.DATA_DEPENDENT:
            self.note(str(func))
        elif func is aten.index.Tensor and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            self.note("boolean mask index")
        return func(*args, **(kwargs or {}))


def _host_reads_per_iteration(monkeypatch, global_batch_size: int):
    sys.path.insert(0, str(REPO))
    import pretrain_gpt
    from megatron.training import global_vars, training

    reads = HostReads()
    for name in ("tolist", "cpu", "numpy"):
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _method=method, _name=name, **kwargs):
            reads.note(_name)
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    real_step = training.train_step

    def train_step(*args, **kwargs):  # what follows, up to the next step, is this iteration's
        reads.iteration = 1 if reads.iteration is None else reads.iteration + 1
        return real_step(*args, **kwargs)

    monkeypatch.setattr(training, "train_step", train_step)
    global_vars.reset_globals()
    try:
        with reads:
            pretrain_gpt.pretrain(
                pretrain_gpt.train_valid_test_datasets_provider,
                pretrain_gpt.model_provider,
                pretrain_gpt.ModelType.encoder_or_decoder,
                pretrain_gpt.forward_step,
                argv=FLAGS + ["--global-batch-size", str(global_batch_size)],
            )
    finally:
        global_vars.reset_globals()
        monkeypatch.undo()
    return reads.counts


def _sites(counter):
    return {(path, function) for (_, path, function) in counter}


def test_no_host_read_per_micro_batch_beyond_megatrons(monkeypatch):
    # --micro-batch-size 2: 1 and 4 micro-batches per iteration.
    one = _host_reads_per_iteration(monkeypatch, 2)
    four = _host_reads_per_iteration(monkeypatch, 8)
    assert sorted(one) == sorted(four) == [1, 2], (one, four)
    for iteration in (1, 2):
        grown = {
            key: four[iteration][key] - one[iteration][key]
            for key in four[iteration]
            if four[iteration][key] > one[iteration][key]
        }
        not_megatrons = {
            key: n for key, n in grown.items() if key[1:] not in PER_MICROBATCH_ALLOWED
        }
        assert not not_megatrons, f"host reads that grow with the micro-batches: {not_megatrons}"
        # The detector sees the schedule's path: Megatron's own reads do grow.
        assert _sites(grown) == set(PER_MICROBATCH_ALLOWED), grown

    # Iteration 1 prints nothing: the reported losses stay on the device; iteration 2 reads them.
    for counts in (one, four):
        quiet = {
            site for site in _sites(counts[1]) if site in LOG_PATH or site[0] in LOG_PATH_FILES
        }
        assert not quiet, f"host reads at an iteration that logs nothing: {quiet}"
        assert any(path in LOG_PATH_FILES for path, _ in _sites(counts[2])), counts[2]
