"""Training on a CPU with the implicit device sent elsewhere, so that a tensor made without a
device fails the way it fails on a GPU.

On a GPU a factory call without ``device=`` makes a CPU tensor while the step computes on CUDA;
the first GPU run failed at iteration 1 that way (schedules.py's token counters met a CUDA count;
the rerun machine all-reduced CPU flags over NCCL). Here the compute device is the CPU, so
:class:`ImplicitDevice` gives the factory calls of the project's own files (megatron/,
pretrain_*.py, tools/) that name no device the meta device instead, and fails any torch call in
which such a tensor meets a real one (0-d tensors included, which torch lets a meta tensor
absorb) and any collective handed one (c10d's meta kernels would let it pass silently).
``.item()`` and ``.tolist()`` of a meta tensor fail by themselves.

Why not ``torch.set_default_device("meta")`` itself: torch's own code relies on the default
device being the host, as it is on a GPU run (the DataLoader draws its base seed with
``torch.empty((), dtype=torch.int64).random_().item()``, which fails on meta), so the default
applies to the calls of the project's files only.

Every configuration trains 3 iterations with every honoured logging option on and an evaluation
every 2 iterations, in one spawned 2-rank gloo world (one in-process ``pretrain(argv=...)`` per
rank and configuration). What cannot run this way, and why:

* data-loader worker processes (``--num-workers`` > 0) run outside the patched process; the
  loaders here run in the main process, so the dataset code is covered;
* the meeting check is a torch function mode, which the autograd engine does not apply to
  backward functions; their factory calls still make meta tensors, which torch's own device
  checks reject except as 0-d operands;
* W&B (it logs Python floats, and wandb starts a service of its own), the asynchronous
  checkpoint writer (a thread; the synchronous torch_dist save and its resume run), FSDP2
  (DTensor and the device mesh are torch's code) and the text-generation server are left out;
* ``--check-weight-hash-across-dp-replicas-interval`` is left out of the expert-parallel run:
  it compares the experts over the dense data-parallel group, so it fails every EP run.
"""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_flatten

from tests.harness import REPO
from tests.unit_tests.dist_utils import run_distributed

IMPLICIT = torch.device("meta")
_PROJECT_FILES = tuple(
    str(REPO / part) for part in ("megatron/", "pretrain_", "tools/", "examples/")
)


# The collectives the project calls; a meta tensor passes through them silently (c10d has meta
# kernels for tracing), so they are guarded by hand. isend/irecv stay as they are: P2POp checks
# their identity; batch_isend_irecv is guarded instead.
_COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all", "all_to_all_single",
    "batch_isend_irecv", "broadcast", "gather", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "send",
)  # fmt: skip


def _refusing_implicit_tensors(name, collective):
    def guarded(*args, **kwargs):
        if name == "batch_isend_irecv":
            tensors = [op.tensor for op in args[0]]
        else:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type == IMPLICIT.type for t in tensors):
            raise RuntimeError(
                f"torch.distributed.{name}: a tensor made without a device (on a GPU run: a CPU "
                "tensor handed to NCCL); make it on megatron.core.device.collective_device(group)"
            )
        return collective(*args, **kwargs)

    return guarded


class ImplicitDevice(TorchFunctionMode):
    """While active, the project's factory calls without a device make ``meta`` tensors; a torch
    call where one meets a tensor of another device raises, and so does a collective given one.

    The factories are replaced in the torch namespace (not only intercepted by this mode): the
    autograd engine runs backward functions outside any torch function mode, and backward code
    makes tensors too. The meeting check is the mode's, so it covers forward code; in backward,
    torch's own device checks remain (they let a 0-d tensor pass).
    """

    def __init__(self):
        super().__init__()
        self.implicit_calls = 0
        self._originals = {}

    def _factory(self, original):
        def factory(*args, **kwargs):
            if kwargs.get("device") is None and sys._getframe(1).f_code.co_filename.startswith(
                _PROJECT_FILES
            ):
                kwargs["device"] = IMPLICIT
                self.implicit_calls += 1
            return original(*args, **kwargs)

        return factory

    def __enter__(self):
        for f in _device_constructors():
            if getattr(torch, f.__name__, None) is f:
                self._originals[(torch, f.__name__)] = f
                setattr(torch, f.__name__, self._factory(f))
        for name in _COLLECTIVES:
            collective = getattr(dist, name)
            self._originals[(dist, name)] = collective
            setattr(dist, name, _refusing_implicit_tensors(name, collective))
        return super().__enter__()

    def __exit__(self, *exc_info):
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals = {}
        return super().__exit__(*exc_info)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {
            t.device.type for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        if IMPLICIT.type in devices and len(devices) > 1:
            raise RuntimeError(
                f"{getattr(func, '__qualname__', func)}: a tensor made without a device meets a "
                f"{' and '.join(sorted(devices - {IMPLICIT.type}))} tensor (on a GPU run: a CPU "
                "tensor meets a CUDA one); name its device"
            )
        return func(*args, **kwargs)


LIBRARY_CODE = """
def count_tokens(num_tokens):
    total = torch.tensor(0, dtype=torch.int)
    total += num_tokens

def agree(flag):
    flags = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(flags)

class Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.full((3,), 2.0)
"""


def test_implicit_tensors_fail_where_a_gpu_run_fails():
    # Compiled under a file name of the library: the two bugs of the first GPU run, in short.
    library = {"torch": torch, "dist": dist}
    exec(compile(LIBRARY_CODE, str(REPO / "megatron" / "core" / "sample.py"), "exec"), library)
    zeros = torch.zeros
    with ImplicitDevice() as mode:
        with pytest.raises(RuntimeError, match="add_: a tensor made without a device meets a cpu"):
            library["count_tokens"](torch.ones(3).sum().int())
        with pytest.raises(RuntimeError, match="all_reduce: a tensor made without a device"):
            library["agree"](True)
        x = torch.ones(3, requires_grad=True)
        with pytest.raises(RuntimeError, match="device meta is not on the expected device cpu"):
            library["Doubled"].apply(x).sum().backward()  # backward code is covered too
        assert mode.implicit_calls == 3
        assert (torch.tensor(0) + torch.ones(3)).device.type == "cpu"  # this file's calls
    assert torch.zeros is zeros and torch.tensor(0).device.type == "cpu"


# ------------------------------------------------------------------------------- the runs
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 "
    "--lr 5e-3 --lr-warmup-iters 1 --num-workers 0 --seed 1234 --hidden-dropout 0.1 "
    "--attention-dropout 0.1 "
)
GPT = TINY + "--mock-data --tokenizer-type NullTokenizer --vocab-size 500 "
SENTENCES = "--data-path {corpus} --vocab-file {vocab} --split 90,10,0 "
# Every honoured logging option, a log line every iteration and an evaluation every two.
LOGGING = (
    "--log-interval 1 --eval-interval 2 --eval-iters 1 --log-params-norm --log-num-zeros-in-grad "
    "--log-throughput --timing-log-level 2 --timing-log-option all --tensorboard-dir {run}/tb "
    "--log-timers-to-tensorboard --log-validation-ppl-to-tensorboard --log-memory-to-tensorboard "
    "--log-world-size-to-tensorboard --log-straggler --straggler-minmax-count 2 "
)
# Not with expert parallelism (see the module's docstring).
WEIGHT_HASH_CHECK = "--check-weight-hash-across-dp-replicas-interval 1 "

# name: (entry script, flags)
RUNS = {
    # Data parallel with everything around the step: the distributed optimizer, fp16 with its
    # dynamic loss scale, per-token loss (the token counts are all-reduced), the rerun machine's
    # checks, the exit checks, and a torch_dist save with the progress log.
    "gpt-dp2-features": (
        "pretrain_gpt",
        GPT + "--use-distributed-optimizer --fp16 --calculate-per-token-loss "
        "--rerun-mode validate_results --check-for-spiky-loss --check-for-large-grads "
        "--exit-signal-handler --exit-duration-in-mins 1000 --save {run}/ckpt --save-interval 3 "
        "--ckpt-format torch_dist --log-progress " + WEIGHT_HASH_CHECK,
    ),
    # Resumes the run above (model, distributed optimizer state, RNG states) for a 4th iteration.
    "gpt-dp2-resume": (
        "pretrain_gpt",
        GPT.replace("--train-iters 3", "--train-iters 4") + "--use-distributed-optimizer --fp16 "
        "--calculate-per-token-loss --ckpt-format torch_dist --load {tmp}/gpt-dp2-features/ckpt "
        "--override-opt-param-scheduler " + WEIGHT_HASH_CHECK,
    ),
    "gpt-tp2-sp": (
        "pretrain_gpt",
        GPT + "--tensor-model-parallel-size 2 --sequence-parallel --bf16 "
        "--position-embedding-type rope --swiglu " + WEIGHT_HASH_CHECK,
    ),
    "gpt-pp2-vpp2": (
        "pretrain_gpt",
        GPT.replace("--num-layers 2", "--num-layers 4") + "--pipeline-model-parallel-size 2 "
        "--num-layers-per-virtual-pipeline-stage 1 " + WEIGHT_HASH_CHECK,
    ),
    "gpt-cp2": ("pretrain_gpt", GPT + "--context-parallel-size 2 " + WEIGHT_HASH_CHECK),
    "moe-ep2": (
        "pretrain_gpt",
        GPT + "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 "
        "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-router-enable-expert-bias "
        "--moe-router-score-function sigmoid --moe-router-load-balancing-type global_aux_loss "
        "--moe-aux-loss-coeff 0.01 --moe-per-layer-logging --bf16 " + WEIGHT_HASH_CHECK,
    ),
    "bert-tp2": (
        "pretrain_bert",
        TINY.replace("32", "64") + SENTENCES + "--tensor-model-parallel-size 2 "
        + WEIGHT_HASH_CHECK,
    ),
    "t5-dp2": (
        "pretrain_t5",
        TINY.replace("--num-layers 2", "--encoder-num-layers 2 --decoder-num-layers 2")
        .replace("--seq-length 32", "--encoder-seq-length 64 --decoder-seq-length 32")
        .replace("--max-position-embeddings 32", "--max-position-embeddings 64")
        + SENTENCES + "--vocab-extra-ids 100 " + WEIGHT_HASH_CHECK,
    ),
}  # fmt: skip


def _argv(name: str, corpus: str, tmp: Path) -> list:
    vocab = REPO / "tests" / "data" / "bert-vocab.txt"
    flags = (RUNS[name][1] + LOGGING).split()  # split first: paths may hold spaces
    return [flag.format(corpus=corpus, vocab=vocab, run=tmp / name, tmp=tmp) for flag in flags]


def _pretrain(entry: str, argv: list) -> int:
    """One in-process pretrain() of ``entry`` (pretrain_gpt, ...) under :class:`ImplicitDevice`;
    returns how many factory calls made a meta tensor."""
    import importlib

    from megatron.training import global_vars
    from megatron.training.model_families import get_model_family

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    script = importlib.import_module(entry)
    script.train_valid_test_datasets_provider.is_distributed = True
    family = entry.split("_", 1)[1]
    global_vars.reset_globals()
    try:
        with ImplicitDevice() as mode:
            script.pretrain(
                script.train_valid_test_datasets_provider,
                script.model_provider,
                script.ModelType.encoder_and_decoder
                if family == "t5"
                else script.ModelType.encoder_or_decoder,
                script.forward_step,
                argv=argv,
                model_family=get_model_family(family),
            )
    finally:
        global_vars.reset_globals()
    return mode.implicit_calls


def _train(rank, world_size, corpus, tmp, names):
    from megatron.core.device import backends_by_device_type, collective_device, compute_device

    # A gloo world: the host computes and reduces.
    assert backends_by_device_type() == {"cpu": "gloo", "cuda": "gloo"}
    assert compute_device() == collective_device() == torch.device("cpu")
    for name in names:
        entry, argv = RUNS[name][0], _argv(name, corpus, Path(tmp))
        print(f"==== {name}: {entry} {' '.join(argv)}", flush=True)
        started = time.perf_counter()
        implicit = _pretrain(entry, argv)
        print(
            f"==== {name}: trained in {time.perf_counter() - started:.1f} s; {implicit} factory "
            "calls without a device, none of whose tensors met a real one",
            flush=True,
        )
    dist.barrier()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """200 documents of the shipped corpus, sentence-split for BERT and T5."""
    out = tmp_path_factory.mktemp("implicit_devices")
    lines = (REPO / "tests" / "data" / "corpus.jsonl").read_text().splitlines()[:200]
    (out / "docs.jsonl").write_text("\n".join(lines) + "\n")
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "preprocess_data.py"),
            "--input",
            str(out / "docs.jsonl"),
            "--output-prefix",
            str(out / "corpus"),
            "--tokenizer-type",
            "BertWordPieceLowerCase",
            "--vocab-file",
            str(REPO / "tests" / "data" / "bert-vocab.txt"),
            "--split-sentences",
            "--workers",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return str(out / "corpus_text_sentence")


def test_every_layout_and_training_feature_makes_no_tensor_on_an_implicit_device(corpus, tmp_path):
    from tests.functional_tests.runner import read_tensorboard_scalars

    run_distributed(_train, 2, corpus, str(tmp_path), tuple(RUNS))
    for name in RUNS:  # each run trained its iterations and evaluated
        tb = tmp_path / name / "tb"
        trained = [4] if name == "gpt-dp2-resume" else [1, 2, 3]
        assert sorted(read_tensorboard_scalars(tb, "lm loss")) == trained, name
        evaluated = [4] if name == "gpt-dp2-resume" else [2, 3]
        assert sorted(read_tensorboard_scalars(tb, "lm loss validation")) == evaluated, name
    assert (tmp_path / "gpt-dp2-features" / "ckpt" / "iter_0000003").is_dir()
