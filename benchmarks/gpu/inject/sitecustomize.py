"""Step d of benchmarks/gpu/check.sh puts this directory first on PYTHONPATH, so Python imports
this file at start-up in every process of the run. In a training rank (torchrun sets RANK) with
GPU_CHECK_RAISE_AT_CALL=N, the N-th call of GPTModel.forward (the first micro-batch of the
iteration the step chose) writes the time to GPU_CHECK_RAISED_AT_FILE and raises, as a bug in a
model would."""

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
