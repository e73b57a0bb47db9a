"""Inference and text-generation flags: the static and dynamic-batching engines, CUDA
graphs for inference and inference-time kernels."""

from typing import List, Optional

from megatron.training.flags.spec import flag, flag_group, off_switch, switch, toggle
from megatron.training.flags.types import _parse_cuda_graph_modules_arg


@flag_group("inference")
class InferenceFlags:
    inference_batch_times_seqlen_threshold: int = flag(
        -1, "Split inference batches for pipelining above this batch*seqlen (-1: never)."
    )
    max_tokens_to_oom: int = flag(
        12000,
        "Refuse requests with more tokens (prompt + generation) than this.",
        honoured_at="tools.run_text_generation_server._serve",
    )
    output_bert_embeddings: bool = switch("Output mean-pooled BERT embeddings.")
    bert_embedder_type: str = flag(
        "megatron", "BERT embedder.", type=None, choices=["megatron", "huggingface"]
    )
    flash_decode: bool = switch("Use the flash-decoding kernel.")
    use_legacy_static_engine: bool = switch("Use the legacy static-batching inference engine.")
    inference_max_requests: int = flag(
        8,
        "Maximum concurrent inference requests.",
        honoured_at="tools.run_text_generation_server._check_server_args; "
        "tools.run_text_generation_server._serve",
    )
    inference_max_seq_length: int = flag(
        2560,
        "Maximum inference sequence length (prompt + generation).",
        honoured_at="tools.run_text_generation_server._check_server_args; "
        "tools.run_text_generation_server._serve",
    )
    num_speculative_tokens: int = flag(0, "Tokens drafted per step by speculative decoding.")
    inference_logging_step_interval: int = flag(0, "Steps between inference log lines (0: off).")
    inference_text_gen_server_logging: bool = toggle(False, "Log the text-generation server.")
    inference_wandb_logging: bool = toggle(False, "Report inference metrics to Weights & Biases.")
    inference_coordinator_port: Optional[int] = flag(None, "Port of the inference coordinator.")
    inference_shards: Optional[str] = flag(None, "Inference shard layout.")
    inference_use_synchronous_zmq_collectives: bool = toggle(
        False, "Use synchronous ZMQ collectives between inference ranks."
    )
    inference_disable_ep_consensus: bool = toggle(
        False, "Skip the expert-parallel consensus step of the inference engine."
    )
    mamba_inference_conv_states_dtype: str = flag(
        "bf16", "Dtype of the Mamba conv states during inference.", choices=["bf16", "fp16", "fp32"]
    )
    mamba_inference_ssm_states_dtype: str = flag(
        "bf16", "Dtype of the Mamba ssm states during inference.", choices=["bf16", "fp16", "fp32"]
    )
    inference_dynamic_batching: bool = switch("Use the dynamic-batching inference engine.")
    inference_dynamic_batching_buffer_size_gb: float = flag(40.0, "KV-cache buffer size (GB).")
    inference_dynamic_batching_paused_buffer_size_gb: Optional[float] = flag(
        None, "Buffer for paused requests (GB)."
    )
    inference_dynamic_batching_mamba_memory_ratio: Optional[float] = flag(
        None, "Share of the buffer for Mamba states."
    )
    inference_dynamic_batching_block_size: int = flag(256, "Tokens per KV-cache block.")
    inference_dynamic_batching_max_requests: Optional[int] = flag(None, "Maximum active requests.")
    inference_dynamic_batching_max_tokens: Optional[int] = flag(None, "Maximum active tokens.")
    inference_dynamic_batching_num_cuda_graphs: int = flag(
        16, "CUDA graphs captured for decode batch sizes."
    )
    inference_dynamic_batching_track_paused_request_events: bool = switch(
        "Record pause/resume events per request."
    )
    inference_dynamic_batching_track_generated_token_events: bool = switch(
        "Record an event per generated token."
    )
    inference_dynamic_batching_unified_memory_level: int = flag(
        0, "Use CUDA unified memory for the KV cache (1) or not (0).", choices=[0, 1]
    )
    inference_dynamic_batching_enable_prefix_caching: bool = toggle(
        False,
        "Reuse the KV cache of shared prompt prefixes.",
        options="--inference-dynamic-batching-prefix-caching",
    )
    inference_dynamic_batching_prefix_caching_eviction_policy: str = flag(
        "ref_zero", "Which cached prefix blocks are evicted first.", choices=["ref_zero", "lru"]
    )
    inference_dynamic_batching_prefix_caching_coordinator_policy: str = flag(
        "load_balanced",
        "How the coordinator routes requests with cached prefixes.",
        choices=["longest_prefix", "first_prefix_block", "load_balanced"],
    )
    inference_dynamic_batching_prefix_caching_routing_alpha: float = flag(
        0.5, "Weight of prefix reuse against load when routing."
    )
    inference_dynamic_batching_prefix_caching_mamba_gb: Optional[float] = flag(
        None, "Memory for cached Mamba states (GB)."
    )
    inference_dynamic_batching_cuda_graph_mixed_prefill_count: int = flag(
        16, "Prefill requests covered by the mixed CUDA graphs."
    )
    inference_dynamic_batching_cuda_graph_sizing_distribution: str = flag(
        "exponential",
        "How the captured CUDA-graph batch sizes are spaced.",
        choices=["exponential", "linear"],
    )
    inference_dynamic_batching_sampling_backend: str = flag(
        "torch", "Token sampling implementation.", choices=["torch", "flashinfer"]
    )
    offset_sampling_seed_by_dp_rank: bool = off_switch(
        "Sample with the same seed on every data-parallel rank.",
        options="--use-same-sampling-seed-across-dp-ranks",
    )
    inference_dynamic_batching_async_sched_mode: str = flag(
        "legacy", "Scheduling mode of the dynamic engine.", choices=["legacy", "async"]
    )
    inference_dynamic_batching_logprobs_mode: str = flag(
        "raw_logprobs",
        "Log-probabilities returned: before or after sampling transforms.",
        choices=["raw_logprobs", "processed_logprobs"],
    )
    enable_chunked_prefill: bool = switch("Split long prefills into chunks.")
    cuda_graph_scope_deprecated: Optional[List[str]] = flag(
        None,
        "Deprecated: use --cuda-graph-modules.",
        options="--cuda-graph-scope",
        type=_parse_cuda_graph_modules_arg,
        nargs="+",
    )
    cuda_graph_modules: List[str] = flag(
        [],
        "Modules captured in CUDA graphs (attn, mlp, moe, ...; default: whole layers).",
        type=_parse_cuda_graph_modules_arg,
        nargs="+",
    )
    inference_cuda_graph_scope: Optional[str] = flag(
        None, "What inference CUDA graphs capture.", choices=["none", "layer", "block"]
    )
    decode_only_cuda_graphs: bool = switch("Capture CUDA graphs for decode steps only.")
    inference_cuda_graph_all_prefills: bool = switch("Capture CUDA graphs for every prefill size.")
    inference_cuda_graph_max_tokens: int = flag(512, "Largest token count captured in a graph.")
    symmetric_ar_type: Optional[str] = flag(
        None,
        "Symmetric-memory all-reduce algorithm.",
        choices=["two_shot", "one_shot", "multimem_all_reduce"],
    )
    nccl_all_reduce_for_prefill: bool = switch("Use NCCL all-reduce during prefill.")
    inference_fuse_tp_communication: bool = switch(
        "Fuse tensor-parallel communication at inference."
    )
    inference_disable_triton_nvls_kernels: bool = switch("Do not use the Triton NVLS kernels.")
    inference_grouped_gemm_backend: str = flag(
        "vllm", "Grouped GEMM used by MoE inference.", choices=["flashinfer", "torch", "vllm"]
    )
    inference_moe_disable_fused_quant_kernels: bool = switch(
        "No fused quantization kernels in MoE inference."
    )
    inference_moe_token_dispatcher_type: str = flag(
        "nvls", "Token dispatcher of MoE inference.", choices=["nccl", "nvls"]
    )
    mlp_chunks_for_prefill: int = flag(1, "Chunks the MLP of a prefill is split into.")
