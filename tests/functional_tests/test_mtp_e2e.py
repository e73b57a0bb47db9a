"""Multi-token prediction trains the one-process model at every layout (issue #30): over 10
iterations the lm loss and each ``mtp_k loss`` (within 1e-6) and the grad norm (within 1e-5,
relative) of TP2+SP, DP2, PP2, PP2 with virtual stages and CP2 (a dense GPT, tied embeddings;
CP2 also with --calculate-per-token-loss), EP2 and PP2 (a MoE GPT whose MTP layers are MoE
layers, untied embeddings; its load-balancing loss averages the MTP layers' in, as Megatron's
does) equal the one-process run's; the printed line shows them, and TensorBoard holds
``mtp_1 loss`` and ``mtp_2 loss``.

The one-process runs are in this process, the layouts in one spawned world of 2 processes (see
test_log_line_parity.py, whose helpers this reuses)."""

import json
import os

from tests.functional_tests.runner import TINY_MODEL, read_tensorboard_scalars
from tests.functional_tests.test_log_line_parity import _check_printed, _close, _train
from tests.unit_tests.dist_utils import run_distributed

ITERATIONS = 10
GPT = TINY_MODEL + [
    "--hidden-dropout",
    "0.0",
    "--attention-dropout",
    "0.0",
    "--train-iters",
    str(ITERATIONS),
    "--num-layers",
    "4",
    "--position-embedding-type",
    "rope",
    "--mtp-num-layers",
    "2",
    "--mtp-loss-scaling-factor",
    "0.3",
]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"]
MOE += ["--moe-aux-loss-coeff", "0.01", "--untie-embeddings-and-output-weights"]
MOE += ["--num-layers", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
CASES = {
    "dense": (
        GPT,
        {
            "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
            "dp2": [],
            "pp2": PP2,
            "pp2-vpp2": PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"],
            # --pipeline-model-parallel-layout: 3 + 1 layers; then 4 virtual stages of 1, 1, 2
            # and 0 layers, the last holding only the MTP layers and the loss.
            "pp2-layout": PP2 + ["--pipeline-model-parallel-layout", "Ettt|tmmL"],
            "pp2-layout-vpp2": PP2 + ["--pipeline-model-parallel-layout", "Et|t|tt|mmL"],
            "cp2": ["--context-parallel-size", "2"],
        },
    ),
    "moe": (GPT + MOE, {"ep2": ["--expert-model-parallel-size", "2"], "pp2": PP2}),
    # Per-token loss: the MTP losses weighted by their own token counts (summed over CP).
    "dense-per-token": (
        GPT + ["--calculate-per-token-loss"],
        {"cp2": ["--context-parallel-size", "2"]},
    ),
}
RTOL = {"loss": 1e-6, "grad norm": 1e-5}
MTP_KEYS = {"mtp_1 loss", "mtp_2 loss"}


def _layouts(rank, world_size, path):
    results = {}
    for model, (flags, layouts) in CASES.items():
        for layout, extra in layouts.items():
            received, lines = _train(flags + extra)
            results[f"{model} {layout}"] = (received, {str(k): v for k, v in lines.items()})
    if rank == world_size - 1:  # the rank that prints the line
        with open(path, "w") as f:
            json.dump(results, f)


def test_mtp_layouts_equal_the_one_process_run(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.functional_tests.test_log_line_parity.ITERATIONS", ITERATIONS)
    references = {}
    for model, (flags, _) in CASES.items():
        tb = tmp_path / model
        received, lines = _train(flags + ["--tensorboard-dir", str(tb)])
        _check_printed(f"{model} one process", received, {str(k): v for k, v in lines.items()})
        references[model] = received
        assert MTP_KEYS <= set(received[0]["losses"]), received[0]
        for key in MTP_KEYS:  # TensorBoard: Megatron's tag, the logged value
            written = read_tensorboard_scalars(tb, key)
            assert sorted(written) == list(range(1, ITERATIONS + 1)), (model, key)
            for got in received:
                assert _close(written[got["iteration"]], got["losses"][key], 1e-6), (key, got)
    assert "load_balancing_loss" in references["moe"][0]["losses"]

    path = os.path.join(tmp_path, "layouts.json")
    run_distributed(_layouts, 2, path)
    with open(path) as f:
        results = json.load(f)
    assert set(results) == {f"{m} {lay}" for m, (_, lays) in CASES.items() for lay in lays}
    for name, (received, lines) in results.items():
        _check_printed(name, received, lines)
        ref = references[name.split()[0]]
        assert len(received) == ITERATIONS, name
        worst = {"loss": 0.0, "grad norm": 0.0}
        for got, want in zip(received, ref):
            where = (name, got["iteration"], got, want)
            assert set(got["losses"]) == set(want["losses"]), where
            for key, value in got["losses"].items():
                worst["loss"] = max(worst["loss"], _relative(value, want["losses"][key]))
            worst["grad norm"] = max(
                worst["grad norm"], _relative(got["grad norm"], want["grad norm"])
            )
        print(f"{name}: largest relative deviation {worst}")  # shown with pytest -s
        for key, limit in RTOL.items():
            assert worst[key] <= limit, (name, key, worst[key], received, ref)


def _relative(got, want):
    return abs(got - want) / abs(want)
