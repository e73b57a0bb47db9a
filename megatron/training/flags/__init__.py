"""Megatron-LM's flags, one record each.

* Each flag is a field of a flag group (a dataclass per argparse group of Megatron's parser, in
  the modules of this package): its dest, spellings, type, default, choices, help and, for an
  honoured flag, where it is honoured. ``add_megatron_flags`` builds the parser from ``GROUPS``,
  in the order of Megatron's parser.
* The flags this code base refuses or ignores (speed only) are the rows of ``policy.py``;
  ``POLICY`` is the class of every dest (megatron/training/flag_policy.py applies it).
* The cross-flag rules run in one ordered pass, ``rules.RULES`` (imported on use: some rules need
  torch; nothing else here imports it).
* docs/FLAGS.md is generated from all three by ``doc.py``.
"""

from megatron.training.flags.checkpointing import CheckpointingFlags
from megatron.training.flags.data import (
    DataFlags,
    SFTFlags,
    TokenizerFlags,
)
from megatron.training.flags.distributed import DistributedFlags
from megatron.training.flags.experimental import ExperimentalFlags, MSCFlags
from megatron.training.flags.inference import InferenceFlags
from megatron.training.flags.legacy import BiencoderFlags, VisionFlags
from megatron.training.flags.model import MLAFlags, NetworkSizeFlags, TransformerEngineFlags
from megatron.training.flags.moe import MoEFlags
from megatron.training.flags.monitoring import (
    LoggingFlags,
    OneLoggerFlags,
    OpenTelemetryFlags,
    ProfilingFlags,
    StragglerFlags,
    WorkloadInspectorFlags,
)
from megatron.training.flags.optimizer import (
    InitializationFlags,
    LearningRateFlags,
    RegularizationFlags,
)
from megatron.training.flags.policy import policy_of
from megatron.training.flags.post_training import LogitsDistillationFlags, RLFlags
from megatron.training.flags.precision import MixedPrecisionFlags
from megatron.training.flags.resilience import (
    AutoresumeFlags,
    FaultInjectorFlags,
    FTPackageFlags,
    InProcessRestartFlags,
)
from megatron.training.flags.spec import add_groups
from megatron.training.flags.training import RerunEngineFlags, TrainingFlags, ValidationFlags
from megatron.training.flags.variants import (
    ExperimentalAttentionVariantFlags,
    HeterogeneousFlags,
    HybridModelFlags,
    HyperConnectionFlags,
)

__all__ = ["GROUPS", "POLICY", "add_megatron_flags"]

# Megatron's parser adds its argument groups in this order (it decides the --help text).
GROUPS = (
    NetworkSizeFlags,
    RegularizationFlags,
    TrainingFlags,
    ProfilingFlags,
    RLFlags,
    LogitsDistillationFlags,
    InitializationFlags,
    LearningRateFlags,
    CheckpointingFlags,
    MixedPrecisionFlags,
    DistributedFlags,
    ValidationFlags,
    DataFlags,
    TokenizerFlags,
    AutoresumeFlags,
    BiencoderFlags,
    VisionFlags,
    MoEFlags,
    MLAFlags,
    ExperimentalAttentionVariantFlags,
    HybridModelFlags,
    HyperConnectionFlags,
    HeterogeneousFlags,
    LoggingFlags,
    OneLoggerFlags,
    OpenTelemetryFlags,
    StragglerFlags,
    WorkloadInspectorFlags,
    InferenceFlags,
    TransformerEngineFlags,
    ExperimentalFlags,
    InProcessRestartFlags,
    FaultInjectorFlags,
    FTPackageFlags,
    RerunEngineFlags,
    MSCFlags,
    SFTFlags,
)

POLICY = policy_of(GROUPS)
"""dest -> policy.Rule (HONOURED, NO_EFFECT or REFUSED) of every flag."""


def add_megatron_flags(parser):
    """Add every Megatron argument group to ``parser``; returns it."""
    return add_groups(parser, GROUPS)
