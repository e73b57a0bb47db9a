"""``--test-mode`` (TransformerConfig.test_mode) as Megatron-LM defines it: at every forward an
attention layer with QK layernorm gathers its Q and K layernorm parameters over the
data-parallel and the tensor-parallel group and ends the run if any rank holds other values
(SelfAttention.run_realtime_tests). In a gloo world of 2 ranks, first as TP 2 and then as DP 2:
equal replicas pass, a replica changed by 1e-6 on one rank stops both ranks naming the parameter
and the group, and without --test-mode the same difference goes unnoticed."""

import pytest
import torch

from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.core.tensor_parallel.process_groups import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tiny_configs import tiny_transformer_config


def _worker(rank, world_size):
    torch.set_num_threads(1)
    for tp, group in ((2, "TP"), (1, "DP")):
        state = initialize_model_parallel(tensor_model_parallel_size=tp)
        config = tiny_transformer_config(
            tensor_model_parallel_size=tp, qk_layernorm=True, test_mode=True
        )
        groups = ProcessGroupCollection.from_parallel_state(state)
        attention = SelfAttention(config, pg_collection=groups, qk_layernorm=True)
        hidden = torch.randn(8, 2, config.hidden_size, generator=torch.Generator().manual_seed(0))
        attention.get_query_key_value_tensors(hidden)  # identical replicas: no complaint
        if rank == 1:
            with torch.no_grad():
                attention.k_layernorm.weight[0] += 1e-6
        other = 1 - rank
        with pytest.raises(
            RuntimeError,
            match=rf"--test-mode: layer 1 k_layernorm\.weight differs between {group} ranks "
            rf"{other} and {rank}",
        ):
            attention.get_query_key_value_tensors(hidden)
        config.test_mode = False
        attention.get_query_key_value_tensors(hidden)  # the check runs only in test mode
        destroy_model_parallel()


def test_test_mode_checks_qk_layernorm_replicas_over_tp_and_dp():
    run_distributed(_worker, 2)
