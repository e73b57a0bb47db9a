"""``--moe-grouped-gemm`` follows Megatron-LM's rule (a GPU of compute capability 8.0 or higher,
in any precision; no bf16 requirement): accepted without CUDA, where the grouped experts are plain
PyTorch, in fp32 and fp16, and trains there as the sequential experts do (to the rounding of
the dtype); refused with one line on a GPU older than 8.0."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training.arguments import ArgumentValidationError
from tests.unit_tests.tiny_configs import tiny_args, tiny_gpt_model, tiny_transformer_config

MOE = ["--num-experts", 4, "--moe-router-topk", 2]


@pytest.mark.parametrize("precision", [[], ["--fp16"], ["--bf16"]], ids=["fp32", "fp16", "bf16"])
def test_grouped_gemm_is_accepted_in_any_precision_without_cuda(precision, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = tiny_args(*MOE, "--moe-grouped-gemm", *precision)
    assert args.moe_grouped_gemm


@pytest.mark.parametrize("capability", [(7, 0), (7, 5)])
def test_grouped_gemm_is_refused_on_a_gpu_older_than_8_0(capability, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    message = (
        "--moe-grouped-gemm needs a GPU of compute capability 8.0 or higher, this one has "
        f"{capability[0]}.{capability[1]}"
    )
    with pytest.raises(ArgumentValidationError, match=f"^{message}$"):
        tiny_args(*MOE, "--moe-grouped-gemm", "--bf16")
    # The same GPU without the flag is fine.
    assert not tiny_args(*MOE, "--bf16").moe_grouped_gemm


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)])
def test_grouped_gemm_is_accepted_from_capability_8_0_in_fp32(capability, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert tiny_args(*MOE, "--moe-grouped-gemm").moe_grouped_gemm


def _train(dtype, grouped, steps=3):
    """Losses and final parameters of a tiny MoE GPT over ``steps`` SGD steps on one batch
    (fp16: Megatron's fp16 optimizer, fp32 main weights and loss scaling)."""
    fp16 = dtype == torch.float16
    config = tiny_transformer_config(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_grouped_gemm=grouped,
        gated_linear_unit=True,
        activation_func=F.silu,
        params_dtype=dtype,
        fp16=fp16,
    )
    model = tiny_gpt_model(config, seed=5)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="sgd",
            lr=0.5,
            sgd_momentum=0.0,
            weight_decay=0.0,
            clip_grad=0.0,
            fp16=fp16,
            initial_loss_scale=256.0,
        ),
        [model],
    )
    tokens = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(11))
    positions = torch.arange(6).expand(2, 6)
    losses = []
    for _ in range(steps):  # the same batch: the loss must fall
        optimizer.zero_grad()
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        optimizer.scale_loss(loss).backward()
        assert optimizer.step()[0]
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_grouped_gemm_trains_as_the_sequential_experts(dtype):
    sequential_losses, sequential = _train(dtype, grouped=False)
    grouped_losses, grouped = _train(dtype, grouped=True)
    assert sequential_losses[-1] < 0.7 * sequential_losses[0]  # it trains
    # The grouped experts multiply the same rows by the same weights as the sequential ones
    # (a zero-padded bmm against one mm per expert); only the order in which the kernels sum
    # the products may differ. Two orders of a sum of k terms differ by at most 2 k eps of the
    # sum of the terms' magnitudes (Higham's gamma_k, twice); the longest sums in the expert
    # products run over the hidden size, k = 32, and three SGD steps on one batch, with the
    # loss falling smoothly, do not amplify such a difference. Measured: <= 3 eps.
    bound = 2 * 32 * torch.finfo(dtype).eps
    for ours, theirs in zip(grouped_losses, sequential_losses):
        assert abs(ours - theirs) <= bound * abs(theirs), (grouped_losses, sequential_losses)
    for name, value in sequential.items():
        assert grouped[name].dtype == value.dtype == dtype
        difference = (grouped[name].double() - value.double()).norm()
        assert difference <= bound * value.double().norm(), name
