"""Plot the training curves of several runs side by side into one PNG.

    python tools/plot_logs.py runs/a.log runs/b.log --labels a b --output curves.png
    python tools/plot_logs.py runs/x/tensorboard runs/y/tensorboard --output tb.png

Each input is a training log (stdout holding Megatron's per-interval log line) or a directory
with TensorBoard event files. The figure has one subplot per metric (loss, learning rate,
grad norm, time per iteration) against iteration, one curve per run. Needs matplotlib
(``pip install -e .[plot]``).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.log_parsing import loss_series_names, read_run  # noqa: E402

# (series name, subplot title, y scale)
PANELS = (
    ("loss", "lm loss", "linear"),
    ("learning_rate", "learning rate", "linear"),
    ("grad_norm", "grad norm", "log"),
    ("elapsed_ms", "time per iteration (ms)", "linear"),
)


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("inputs", nargs="+", help="log files and/or TensorBoard directories")
    parser.add_argument(
        "--labels",
        nargs="+",
        default=None,
        help="one legend label per input (default: the file or directory name)",
    )
    parser.add_argument("--output", default="training_curves.png", help="PNG to write")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument(
        "--loss-key",
        default=None,
        help="loss series to plot (default: 'lm loss', else the first loss)",
    )
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.inputs):
        parser.error(f"--labels got {len(args.labels)} labels for {len(args.inputs)} inputs")
    return args


def default_label(path):
    path = os.path.normpath(path)
    name = os.path.basename(path)
    if name in ("tensorboard", "tb", "logs") or name.startswith("events.out"):
        name = os.path.basename(os.path.dirname(path)) or name
    return os.path.splitext(name)[0] if not os.path.isdir(path) else name


def load_runs(inputs, labels=None):
    """[(label, RunMetrics)]; raises ValueError for an input without any metrics."""
    runs = []
    for index, path in enumerate(inputs):
        run = read_run(path)
        if not run.series:
            raise ValueError(f"{path}: no training log lines or TensorBoard scalars found")
        runs.append((labels[index] if labels else default_label(path), run))
    return runs


def _loss_name(run, requested):
    if requested is not None:
        return requested
    names = loss_series_names(run)
    return names[0] if names else "lm loss"


def plot_runs(runs, output, title=None, loss_key=None):
    """Draw the panels of PANELS for every run into ``output`` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    for axis, (name, panel_title, scale) in zip(axes.flat, PANELS):
        drawn = False
        for label, run in runs:
            series = run.get(_loss_name(run, loss_key) if name == "loss" else name)
            if not series:
                continue
            steps = sorted(series)
            values = [series[step] for step in steps]
            positive = all(value > 0 for value in values)
            axis.plot(
                steps,
                values,
                marker="." if len(steps) < 30 else None,
                label=label,
                linewidth=1.4,
                alpha=0.85,
            )
            drawn = True
            if scale == "log" and not positive:
                scale = "linear"
        axis.set_title(panel_title if name != "loss" else (loss_key or panel_title))
        axis.set_xlabel("iteration")
        axis.grid(True, alpha=0.3)
        if drawn:
            axis.set_yscale(scale)
            axis.legend(fontsize=8)
        else:
            axis.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axis.transAxes)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def main(argv=None):
    args = get_args(argv)
    # The inputs first: a bad log is reported whether or not matplotlib is installed.
    try:
        runs = load_runs(args.inputs, args.labels)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "error: tools/plot_logs.py needs matplotlib: pip install -e .[plot] "
            "(or pip install matplotlib -c constraints.txt)",
            file=sys.stderr,
        )
        return 2
    plot_runs(runs, args.output, title=args.title, loss_key=args.loss_key)
    for label, run in runs:
        loss = run.get(_loss_name(run, args.loss_key))
        last = f"last loss {loss[max(loss)]:.4f} at iteration {max(loss)}" if loss else "no loss"
        print(f"{label}: {len(loss)} points, {last} ({run.source})")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
