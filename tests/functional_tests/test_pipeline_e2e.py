"""Pipeline parallelism through torchrun on CPU: every layout gives the one-process losses."""

import pytest

from tests.functional_tests.runner import (
    TINY_MODEL,
    assert_same_training,
    read_tensorboard_scalars,
    run_pretrain,
    world_metrics,
)

EIGHT_LAYERS = [a for a in TINY_MODEL]
EIGHT_LAYERS[EIGHT_LAYERS.index("--num-layers") + 1] = "8"
BASE = EIGHT_LAYERS + [
    "--hidden-dropout",
    "0.0",
    "--attention-dropout",
    "0.0",
    "--train-iters",
    "10",
]


def _losses(args, nproc, tb):
    result = run_pretrain(args + ["--tensorboard-dir", str(tb)], nproc=nproc)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return (
        {
            "loss": read_tensorboard_scalars(tb, "lm loss"),
            "norm": read_tensorboard_scalars(tb, "grad-norm"),
        },
        result,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(BASE, None, tmp_path_factory.mktemp("pp_ref"))[0]


def _assert_close(got, ref):
    assert_same_training(got, ref, range(1, 11))


# The layouts of one world size train one after another in one spawned world (a start costs
# seconds of CPU per rank); each is compared with the one-process run on its own.
WORLDS = {
    2: {
        "pp2": ["--pipeline-model-parallel-size", "2"],
        # PP = 2 interleaved: both neighbours are the same rank (a deadlock once lived here).
        "pp2-interleaved": [
            "--pipeline-model-parallel-size", "2",
            "--num-layers-per-virtual-pipeline-stage", "2",
        ],
    },
    4: {
        "pp4-interleaved": [
            "--pipeline-model-parallel-size", "4",
            "--num-layers-per-virtual-pipeline-stage", "1",
        ],
        "pp4-uneven": [
            "--pipeline-model-parallel-size", "4",
            "--decoder-first-pipeline-num-layers", "1",
            "--decoder-last-pipeline-num-layers", "1",
        ],
    },
    8: {
        "tp2-pp2-dp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        "tp2sp-pp2-cp2": [
            "--tensor-model-parallel-size", "2",
            "--sequence-parallel",
            "--pipeline-model-parallel-size", "2",
            "--context-parallel-size", "2",
        ],
    },
}  # fmt: skip


@pytest.mark.parametrize("world_size", sorted(WORLDS), ids=lambda n: f"world{n}")
def test_layout_matches_one_process(reference, world_size, tmp_path):
    results = world_metrics(BASE, WORLDS[world_size], world_size, tmp_path)
    assert sorted(results) == sorted(WORLDS[world_size])
    for name, got in results.items():
        try:
            _assert_close(got, reference)
        except AssertionError as exc:
            raise AssertionError(f"layout {name}: {exc}") from None


def test_pp2_resume_matches_straight_run(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    pp2 = ["--pipeline-model-parallel-size", "2", "--save", str(ckpt), "--save-interval", "5"]
    first, _ = _losses(BASE + pp2 + ["--exit-interval", "5"], 2, tmp_path / "tb1")
    assert (ckpt / "iter_0000005" / "mp_rank_00_000" / "model_optim_rng.pt").is_file()
    assert (ckpt / "iter_0000005" / "mp_rank_00_001" / "model_optim_rng.pt").is_file()
    second, _ = _losses(BASE + pp2 + ["--load", str(ckpt)], 2, tmp_path / "tb2")
    _assert_close({k: {**first[k], **second[k]} for k in first}, reference)


@pytest.mark.parametrize(
    "layout, words",
    [
        (["--pipeline-model-parallel-size", "3"], ["8", "--pipeline-model-parallel-size (3)"]),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "2",
                "--global-batch-size",
                "3",
                "--micro-batch-size",
                "1",
            ],
            ["micro"],
        ),
        (["--num-layers-per-virtual-pipeline-stage", "2"], ["--pipeline-model-parallel-size"]),
    ],
    ids=["layers-not-divisible", "bad-microbatches-interleaved", "virtual-stages-pp1"],
)
def test_bad_pipeline_flags_fail_before_process_groups(layout, words):
    env = {"WORLD_SIZE": "6" if "3" in layout else "2"}
    result = run_pretrain(BASE + layout, extra_env=env, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    line = [text for text in result.stderr.splitlines() if text.startswith("error:")][-1]
    for w in words:
        assert w in line, line
