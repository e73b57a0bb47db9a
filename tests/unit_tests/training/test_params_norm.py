"""--log-params-norm's counting rules on one rank (the layouts themselves are compared with one
process in tests/functional_tests/test_log_line_parity.py): the tied embedding's copy
(``shared``) is not counted, a param not split over (expert-)tensor parallelism only on its
(expert-)tensor-parallel rank 0, and with --bf16 the fp32 main params are measured, not their
bf16 rounding."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training.params_norm import params_l2_norm


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.split = nn.Parameter(torch.ones(4, 3))
        self.split.tensor_model_parallel = True
        self.replicated = nn.Parameter(torch.ones(5))
        self.tied_copy = nn.Parameter(torch.ones(6))
        self.tied_copy.shared = True
        self.expert = nn.Parameter(torch.ones(2, 2))
        self.expert.allreduce = False


def _state(tp_rank, etp_rank):
    """A rank of one process's view: no groups to reduce over."""
    return SimpleNamespace(
        ranks={},
        get_tensor_model_parallel_rank=lambda: tp_rank,
        get_expert_tensor_parallel_rank=lambda: etp_rank,
        get_model_parallel_group=lambda: None,
        group=lambda name: None,
    )


def _stepped_bf16_model():
    """bf16 params of 1.0 after one SGD step of 1e-3: the fp32 masters hold 0.999, which bf16
    rounds back to 1.0."""
    model = Model().to(torch.bfloat16)
    config = OptimizerConfig(bf16=True, optimizer="sgd", lr=1e-3, weight_decay=0.0)
    config.sgd_momentum = 0.0
    optimizer = get_megatron_optimizer(config, [model])
    for p in model.parameters():
        p.main_grad = torch.ones(p.shape)
    assert optimizer.step()[0]
    masters = {
        half: master
        for halves, group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
        for half, master in zip(halves, group)
    }
    assert len(masters) == 4
    assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())
    return model, optimizer, masters


@pytest.mark.parametrize(
    "tp_rank, etp_rank, counted",
    [
        (0, 0, ["split", "replicated", "expert"]),
        (1, 0, ["split", "expert"]),  # expert params follow the expert-tensor-parallel rank
        (1, 1, ["split"]),
    ],
)
def test_each_param_counted_once_and_bf16_measures_the_main_params(tp_rank, etp_rank, counted):
    model, optimizer, masters = _stepped_bf16_model()
    params = dict(model.named_parameters())
    state = _state(tp_rank, etp_rank)

    main = math.sqrt(sum(float(masters[params[n]].double().pow(2).sum()) for n in counted))
    got = params_l2_norm([model], optimizer, state, use_main_params=True)
    assert got == pytest.approx(main, rel=1e-12)

    rounded = math.sqrt(sum(params[n].numel() for n in counted))  # every bf16 param is 1.0
    got = params_l2_norm([model], optimizer, state, use_main_params=False)
    assert got == pytest.approx(rounded, rel=1e-12)
    assert abs(main - rounded) > 1e-4 * rounded  # the two rules give different numbers
