"""The numbers of the log line are the model's at every parallel layout (issue #27): the losses
(with the MoE auxiliary losses), loss scale, grad norm, num zeros and params norm of TP=2,
TP=2+SP, PP=2, EP=2 and DP=2 with the distributed optimizer equal the one-process run's.

Every layout initializes the one-process model's weights (README), so each number is compared
with the one-process run's, per iteration. They are read on the last rank (the one printing the
line) from what training_log receives, at full precision, and the printed line must show those.
The one-process runs are in this process, the layouts in one spawned world of 2 processes.

- fp16 GPT at TP2, TP2+SP and PP2: the dynamic loss scale starts at 2^22 with hysteresis 1, so
  the first iterations overflow and are skipped (halving it) and later ones step and double it
  every 2: every layout must skip the same iterations with the same scale.
- fp16 GPT at DP2 with the distributed optimizer: the scale starts at 2^16 and grows without
  overflowing. Where an overflow happens is not comparable across DP sizes, in Megatron neither:
  each rank's backward carries the loss of its own DP share averaged, DP times the one-process
  contribution, so it overflows at half the scale (measured: at 2^20, one process at 2^21).
- bf16 GPT (DP2 with the distributed optimizer): the params norm is that of the fp32 main params
  (Megatron's rule for bf16): the mixed-precision optimizer's masters in one process, the slices
  of the distributed optimizer summed over DP here; with Muon, whose distributed optimizer is
  layer-wise, the masters of the whole params each DP rank owns.
- fp32 MoE GPT (EP2, EP2 with the distributed optimizer, TP2+SP with unsplit experts, PP2):
  also ``load_balancing_loss`` and ``z_loss``.

num zeros: untied embeddings, unused positions (--max-position-embeddings 64 > --seq-length 32)
and no linear biases make it a count of structural zeros: the embedding rows of tokens absent
from the batch (split over TP) and of unused positions (replicated over TP, so counted twice if
duplicates were). Biases are left out because a key bias' gradient is zero up to round-off
(softmax ignores a shift shared by all keys): whether one of its entries is exactly 0 depends on
the summation order. For the same reason fp16 counts may differ by a few (a gradient within
fp16's underflow range flushes to zero or not): within 0.2 % there; fp32 and bf16 counts are
equal.
"""

import contextlib
import inspect
import io
import json
import os
import sys

from tests.functional_tests.runner import REPO, TINY_MODEL, parse_log_lines
from tests.unit_tests.dist_utils import run_distributed

ITERATIONS = 5
GPT = TINY_MODEL + [
    "--hidden-dropout",
    "0.0",
    "--attention-dropout",
    "0.0",
    "--train-iters",
    str(ITERATIONS),
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--max-position-embeddings",
    "64",
    "--log-params-norm",
    "--log-num-zeros-in-grad",
]
FP16 = ["--fp16", "--hysteresis", "1", "--loss-scale-window", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"]
MOE += ["--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2"]
DIST_OPT = ["--use-distributed-optimizer"]

# model -> (its flags, {layout: flags at 2 processes}).
CASES = {
    "gpt-fp16-overflowing": (
        GPT + FP16 + ["--initial-loss-scale", str(2**22)],
        {"tp2": TP2, "tp2-sp": TP2 + ["--sequence-parallel"], "pp2": PP2},
    ),
    "gpt-fp16": (GPT + FP16 + ["--initial-loss-scale", str(2**16)], {"dp2-dist-opt": DIST_OPT}),
    "gpt-bf16": (GPT + ["--bf16"], {"dp2-dist-opt": DIST_OPT}),
    "gpt-bf16-muon": (GPT + ["--bf16", "--optimizer", "muon"], {"dp2-dist-opt": DIST_OPT}),
    "moe-fp32": (
        GPT + MOE,
        {
            "ep2": EP2,
            "ep2-dist-opt": EP2 + DIST_OPT,
            "tp2-sp": TP2 + ["--sequence-parallel", "--expert-tensor-parallel-size", "1"],
            "pp2": PP2,
        },
    ),
}
# Relative tolerances, about 10x the largest deviation measured over these layouts (a layout sums
# in another order than one process: float round-off, grown over the steps). fp16: loss 2.3e-6,
# grad norm 4.3e-5, params norm 4.0e-6, num zeros 3.0e-4 (7 of 23k); bf16 and fp32: loss and
# aux losses 1.2e-7, grad norm 2.3e-8, params norm 8.4e-10, num zeros equal. The bugs guarded
# against are percent-sized: before the fix the params norm was 3.6 % low at TP2 and 24 % at PP2.
FP16_RTOL = {"loss": 2e-5, "grad norm": 3e-4, "params norm": 4e-5, "num zeros": 2e-3}
RTOL = {
    "gpt-fp16-overflowing": FP16_RTOL,
    "gpt-fp16": FP16_RTOL,
    "gpt-bf16": {"loss": 1e-6, "grad norm": 1e-6, "params norm": 1e-7, "num zeros": 0.0},
    "gpt-bf16-muon": {"loss": 1e-6, "grad norm": 1e-6, "params norm": 1e-7, "num zeros": 0.0},
    "moe-fp32": {"loss": 1e-6, "grad norm": 1e-6, "params norm": 1e-7, "num zeros": 0.0},
}


def _train(argv):
    """What training_log received at each iteration of an in-process run on this rank, and the
    log lines printed here ({iteration: parsed line})."""
    sys.path.insert(0, str(REPO))
    import pretrain_gpt
    from megatron.training import global_vars, training

    received = []
    real = training.training_log
    names = list(inspect.signature(real).parameters)

    def spy(*args, **kwargs):
        given = {**dict(zip(names, args)), **kwargs}
        received.append(
            {
                "iteration": given["iteration"],
                "skipped": given["skipped_iter"],
                "losses": {k: float(v) for k, v in given["loss_dict"].items()},
                "loss scale": given["loss_scale"],
                "grad norm": given["grad_norm"],
                "num zeros": given["num_zeros_in_grad"],
                "params norm": given["params_norm"],
            }
        )
        return real(*args, **kwargs)

    training.training_log = spy
    global_vars.reset_globals()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            pretrain_gpt.pretrain(
                pretrain_gpt.train_valid_test_datasets_provider,
                pretrain_gpt.model_provider,
                pretrain_gpt.ModelType.encoder_or_decoder,
                pretrain_gpt.forward_step,
                argv=argv,
            )
    finally:
        training.training_log = real
        global_vars.reset_globals()
    return received, parse_log_lines(out.getvalue())


def _layouts(rank, world_size, path):
    results = {}
    for model, (flags, layouts) in CASES.items():
        for layout, extra in layouts.items():
            received, lines = _train(flags + extra)
            results[f"{model} {layout}"] = (received, {str(k): v for k, v in lines.items()})
    if rank == world_size - 1:  # the rank that prints the line
        with open(path, "w") as f:
            json.dump(results, f)


def _check_printed(name, received, lines):
    """The printed line of every iteration shows what training_log received."""
    assert sorted(int(k) for k in lines) == list(range(1, ITERATIONS + 1)), (name, lines)
    for got in received:
        line = lines[str(got["iteration"])]
        where = (name, got["iteration"])
        assert line["loss_scale"] == f"{got['loss scale']:.1f}", where
        for key, fmt in (("grad_norm", "{:.3f}"), ("params_norm", "{:.3f}"), ("num_zeros", "{}")):
            value = got[key.replace("_", " ")]
            assert line[key] == (None if value is None else fmt.format(value)), (where, key)
        # A skipped iteration's losses are not averaged into the line (Megatron's rule).
        shown = {} if got["skipped"] else {k: float(f"{v:.6E}") for k, v in got["losses"].items()}
        assert line["losses"] == shown, where


def _close(got, ref, rtol):
    if ref is None or got is None:
        return got is ref
    return abs(got - ref) <= rtol * abs(ref)


def test_log_line_numbers_equal_the_one_process_run(tmp_path):
    references = {}
    for model, (flags, _) in CASES.items():
        received, lines = _train(flags)
        _check_printed(f"{model} one process", received, {str(k): v for k, v in lines.items()})
        references[model] = received
    # The cases exercise what they claim: fp16 skips iterations and changes its scale; the MoE
    # model logs its auxiliary losses; every model has structural zeros.
    overflowing = references["gpt-fp16-overflowing"]
    assert {r["skipped"] for r in overflowing} == {0, 1}, overflowing
    scales = [r["loss scale"] for r in overflowing]
    assert any(b < a for a, b in zip(scales, scales[1:])), scales  # halved after an overflow
    assert any(b > a for a, b in zip(scales, scales[1:])), scales  # grown after 2 steps
    assert len({r["loss scale"] for r in references["gpt-fp16"]}) >= 2, references["gpt-fp16"]
    assert set(references["moe-fp32"][0]["losses"]) == {"lm loss", "load_balancing_loss", "z_loss"}
    counts = [r["num zeros"] for refs in references.values() for r in refs if not r["skipped"]]
    assert min(counts) > 1000, counts

    path = os.path.join(tmp_path, "layouts.json")
    run_distributed(_layouts, 2, path)
    with open(path) as f:
        results = json.load(f)
    for name, (received, lines) in results.items():
        _check_printed(name, received, lines)
        model = name.split()[0]
        rtol = RTOL[model]
        assert len(received) == ITERATIONS, name
        for got, ref in zip(received, references[model]):
            where = (name, got["iteration"], got, ref)
            assert got["iteration"] == ref["iteration"], where
            assert got["skipped"] == ref["skipped"], where
            assert got["loss scale"] == ref["loss scale"], where
            assert set(got["losses"]) == set(ref["losses"]), where
            for key, value in got["losses"].items():
                assert _close(value, ref["losses"][key], rtol["loss"]), (key, where)
            for key in ("grad norm", "params norm", "num zeros"):
                assert _close(got[key], ref[key], rtol[key]), (key, where)
