"""Step d of benchmarks/gpu/check.sh puts this directory first on PYTHONPATH, so Python imports
this file at start-up in every process of the run. In a training rank (torchrun sets RANK) with
GPU_CHECK_RAISE_AT_CALL=N, the N-th call of GPTModel.forward (the first micro-batch of the
iteration the step chose) writes the time to GPU_CHECK_RAISED_AT_FILE and raises, as a bug in a
model would. With GPU_PERF_PROFILE_FIRST (benchmarks/gpu/perf.sh) it profiles whole iterations
instead (below)."""

import os

if os.environ.get("RANK") is not None and os.environ.get("GPU_CHECK_RAISE_AT_CALL"):
    import time

    import megatron.core.models.gpt.gpt_model as _gpt_model

    _forward = _gpt_model.GPTModel.forward
    _calls = [0]
    _raise_at = int(os.environ["GPU_CHECK_RAISE_AT_CALL"])

    def _forward_that_fails(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == _raise_at:
            with open(os.environ["GPU_CHECK_RAISED_AT_FILE"], "w") as marker:
                marker.write(repr(time.time()))
            raise RuntimeError(os.environ.get("GPU_CHECK_MESSAGE", "gpu-check: injected failure"))
        return _forward(self, *args, **kwargs)

    _gpt_model.GPTModel.forward = _forward_that_fails

if os.environ.get("RANK") is not None and os.environ.get("GPU_PERF_PROFILE_FIRST"):
    # benchmarks/gpu/perf.sh: torch.profiler around train_step calls FIRST .. FIRST + COUNT - 1
    # (whole iterations), then the kernel time by family (kernels.py) as JSON to
    # GPU_PERF_PROFILE_OUT. Megatron's --use-pytorch-profiler is refused here, and this leaves
    # the run itself untouched outside those iterations.
    import json
    import sys
    import time

    import torch

    import megatron.training.training as _training

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernels as _kernels

    _train_step = _training.train_step
    _first = int(os.environ["GPU_PERF_PROFILE_FIRST"])
    _last = _first + int(os.environ.get("GPU_PERF_PROFILE_COUNT", "2")) - 1
    _device = "cuda" if torch.cuda.is_available() else "cpu"
    _state = {"calls": 0}

    def _sync():
        if _device == "cuda":
            torch.cuda.synchronize()

    def _profiled_train_step(*args, **kwargs):
        _state["calls"] += 1
        call = _state["calls"]
        if call == _first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if _device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            _sync()
            _state["profiler"] = torch.profiler.profile(activities=activities)
            _state["profiler"].__enter__()
            _state["start"] = time.perf_counter()
        result = _train_step(*args, **kwargs)
        if call == _last and "profiler" in _state:
            _sync()
            wall_us = (time.perf_counter() - _state["start"]) * 1e6
            profiler = _state.pop("profiler")
            profiler.__exit__(None, None, None)
            listed = _kernels.profiler_kernels(profiler, _device)
            rows = [(name, us) for name, us, _ in listed]
            report = {
                "device": _device,
                "iterations": _last - _first + 1,
                "wall_us": wall_us,
                "families_us": _kernels.summarize(rows),
                "top_other": _kernels.top_unclassified(rows),
                "top_kernels": _kernels.top_kernels(listed, _last - _first + 1),
                "rows": len(rows),
            }
            with open(os.environ["GPU_PERF_PROFILE_OUT"], "w") as out:
                json.dump(report, out, indent=2)
        return result

    _training.train_step = _profiled_train_step
