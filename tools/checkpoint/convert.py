"""Convert checkpoints between formats and parallel layouts (Megatron's
tools/checkpoint/convert.py).

    python tools/checkpoint/convert.py --model-type GPT --loader hf_llama --saver core \\
        --load-dir /path/to/hf_model --save-dir ckpt/llama --target-tensor-parallel-size 2

A loader plugin (module ``loader_<name>``) runs in this process and sends the model over a
``multiprocessing.Queue``, one message at a time, to a saver plugin (``saver_<name>``) running in
a child process; the messages are described in ``protocol.py``. Plugins: ``core`` (our torch-format
checkpoints at any TP/PP, and torch_dist ones as a loader; ``mcore`` and ``megatron`` are aliases),
``hf_gpt2`` (GPT-2), ``hf_llama`` (Llama 2/3, Mistral, Qwen2, Mixtral) and ``hf_deepseek_v3``
(DeepSeek-V3-class MLA + MoE models); for ``--model-type MAMBA`` (hybrid models,
``protocol_hybrid.py``) ``core`` and ``hf_nemotron_h`` (NemotronH). Everything runs on the CPU,
offline.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
import queue as queue_module
import sys
import threading
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
_ROOT = os.path.dirname(os.path.dirname(_HERE))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from protocol import ConversionError, put  # noqa: E402

_ALIASES = {"megatron": "core", "mcore": "core", "legacy": "core"}
PLUGINS = ("core", "hf_gpt2", "hf_llama", "hf_deepseek_v3", "hf_nemotron_h")


def load_plugin(kind: str, name: str):
    """Module ``<kind>_<name>`` (or the bare module name, as Megatron accepts)."""
    name = _ALIASES.get(name, name)
    for module_name in (f"{kind}_{name}", name):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        entry = "load_checkpoint" if kind == "loader" else "save_checkpoint"
        if not hasattr(module, entry) or not hasattr(module, "add_arguments"):
            raise ConversionError(
                f"module {module_name} is not a checkpoint {kind} plugin "
                f"(it lacks add_arguments / {entry})"
            )
        return module
    raise ConversionError(
        f"unknown --{kind} '{name}': no module {kind}_{name} in {_HERE}; "
        f"available: {', '.join(PLUGINS)}"
    )


def model_types():
    """{--model-type: how it converts} from each family's ``TrainSpec.checkpoint_converter``
    ("plugins": the loader/saver plugins below; else a module of this folder with
    ``add_arguments(parser)`` and ``convert(args)``); GPT first, as Megatron lists it."""
    from megatron.training.model_families import get_model_family, model_family_names

    converters = {}
    for name in model_family_names():
        converter = get_model_family(name).checkpoint_converter
        if converter is not None:
            converters[name.upper()] = converter
    return dict(sorted(converters.items(), key=lambda item: item[0] != "GPT"))


def build_parser():
    parser = argparse.ArgumentParser(
        description="Megatron checkpoint converter", allow_abbrev=False, conflict_handler="resolve"
    )
    types = model_types()
    own = "".join(
        f" ({name}: see {module}.py for its loaders and savers)"
        for name, module in types.items()
        if module != "plugins"
    )
    parser.add_argument(
        "--model-type",
        type=str,
        required=True,
        choices=list(types),
        help=f"Type of the model{own}.",
    )
    parser.add_argument(
        "--loader", type=str, default="core", help="Loader plugin (module loader_<name>)."
    )
    parser.add_argument(
        "--saver", type=str, default="core", help="Saver plugin (module saver_<name>)."
    )
    parser.add_argument(
        "--load-dir", type=str, required=True, help="Directory to load the model from."
    )
    parser.add_argument(
        "--save-dir", type=str, required=True, help="Directory to save the model to."
    )
    parser.add_argument(
        "--max-queue-size", type=int, default=50, help="Maximum messages in flight."
    )
    parser.add_argument(
        "--no-checking",
        action="store_false",
        dest="checking",
        help="Do not fail on tensors the saver does not know.",
    )
    return parser


def parse(argv=None):
    """Two passes, as Megatron's converter: the plugin names first, then every plugin's flags."""
    # The first pass reads only the plugin names (no --help, no required flags), so that --help
    # lists the plugins' flags too.
    names = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    names.add_argument("--loader", default="core")
    names.add_argument("--saver", default="core")
    names.add_argument("--model-type")
    known, _ = names.parse_known_args(argv)
    parser = build_parser()
    converter = model_types().get(known.model_type, "plugins")
    if converter != "plugins":  # the family's own converter takes every flag
        importlib.import_module(converter).add_arguments(parser)
        args = parser.parse_args(argv)
        if os.path.abspath(args.load_dir) == os.path.abspath(args.save_dir):
            raise ConversionError("--save-dir must differ from --load-dir")
        return args, None, None
    loader = load_plugin("loader", known.loader)
    saver = load_plugin("saver", known.saver)
    loader.add_arguments(parser)
    saver.add_arguments(parser)
    args = parser.parse_args(argv)
    check_model_type(
        args.model_type, {"loader": (known.loader, loader), "saver": (known.saver, saver)}
    )
    args.no_checking = not args.checking
    if os.path.abspath(args.load_dir) == os.path.abspath(args.save_dir):
        raise ConversionError("--save-dir must differ from --load-dir")
    return args, loader, saver


def check_model_type(model_type: str, plugins: dict) -> None:
    """Each plugin lists the --model-type values it converts in ``MEGATRON_MODEL_TYPES`` (GPT
    when it does not say)."""
    for kind, (name, module) in plugins.items():
        types = getattr(module, "MEGATRON_MODEL_TYPES", ("GPT",))
        if model_type not in types:
            raise ConversionError(
                f"--model-type {model_type}: the {name} {kind} converts {'/'.join(types)} "
                "models only"
            )


def _run_saver(saver_name: str, q, args, status):
    """Child process (or thread) body: run the saver, report failure through ``status``."""
    try:
        saver = load_plugin("saver", saver_name)
        saver.save_checkpoint(q, args)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        status.put(str(exc))
        return
    except Exception as exc:  # an unexpected failure: keep the traceback for a bug report
        traceback.print_exc()
        status.put(f"{type(exc).__name__}: {exc}")
        return
    status.put(None)


def convert(argv=None, in_process: bool = False) -> None:
    """Run a conversion; raises ConversionError on failure.

    ``in_process`` runs the saver in a thread instead of a child process (same protocol; used by
    tests to save the process start-up)."""
    args, loader, saver = parse(argv)
    converter = model_types()[args.model_type]
    if converter != "plugins":
        importlib.import_module(converter).convert(args)
        return
    if in_process:
        q, status = queue_module.Queue(maxsize=args.max_queue_size), queue_module.Queue()
        worker = threading.Thread(
            target=_run_saver, args=(args.saver, q, args, status), daemon=True
        )
    else:
        ctx = mp.get_context("spawn")  # fork after torch has started threads can hang
        q, status = ctx.Queue(maxsize=args.max_queue_size), ctx.Queue()
        worker = ctx.Process(target=_run_saver, args=(args.saver, q, args, status))
    worker.start()
    try:
        loader.load_checkpoint(q, args, alive=worker.is_alive)
    except BaseException:
        try:
            put(q, "exit", None, alive=worker.is_alive)
        except ConversionError:
            pass
        worker.join()
        raise
    worker.join()
    try:
        failure = status.get(timeout=5)
    except queue_module.Empty:
        failure = "it exited without reporting (killed?)"
    if failure is not None:
        raise ConversionError(
            f"{args.saver} saver: {failure}; nothing usable was written to {args.save_dir}"
        )


def main(argv=None) -> int:
    try:
        convert(argv)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    print("conversion done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
