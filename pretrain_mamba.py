"""Pretrain a hybrid Mamba / attention model (Nemotron-H style):
``torchrun --nproc-per-node N pretrain_mamba.py --hybrid-override-pattern M*M- <flags>``.

The family's parts are in megatron/training/model_families/mamba/."""

from megatron.core.enums import ModelType  # noqa: F401  (Megatron's scripts export it)
from megatron.training.model_families import get_model_family
from megatron.training.training import pretrain

SPEC = get_model_family("mamba")
# Megatron's names: scripts, tools and tests import them from here.
model_provider = SPEC.model_provider
forward_step = SPEC.forward_step
train_valid_test_datasets_provider = SPEC.train_valid_test_datasets_provider

if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        SPEC.model_type,
        forward_step,
        model_family=SPEC,
    )
