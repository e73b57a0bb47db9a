"""Checkpoint flags: where and how often to save, what to load, formats, conversion."""

from typing import Optional

from megatron.training.flags.spec import flag, flag_group, off_switch, switch


@flag_group("checkpointing")
class CheckpointingFlags:
    save: Optional[str] = flag(
        None,
        "Directory to save checkpoints to.",
        honoured_at="model_setup.setup_model_and_optimizer; training._pretrain; "
        "training._train_loop",
    )
    save_interval: Optional[int] = flag(
        None,
        "Iterations between checkpoint saves.",
        options=("--save-interval", "--persistent-save-interval"),
        honoured_at="exit_decision.checkpoint_and_decide_exit",
    )
    save_params_interval: Optional[int] = flag(
        None, "Iterations between dumps of the params (debugging aid)."
    )
    save_activations_interval: Optional[int] = flag(
        None, "Iterations between dumps of the activations (debugging aid)."
    )
    save_tokens_per_expert_interval: Optional[int] = flag(
        None, "Iterations between dumps of the tokens per expert (debugging aid)."
    )
    save_wgrads_interval: Optional[int] = flag(
        None, "Iterations between dumps of the wgrads (debugging aid)."
    )
    save_dgrads_interval: Optional[int] = flag(
        None, "Iterations between dumps of the dgrads (debugging aid)."
    )
    save_retain_interval: Optional[int] = flag(
        None,
        "Keep only checkpoints at multiples of this interval (and the latest); delete the others.",
        honoured_at="megatron.checkpointing.layout.remove_unretained",
    )
    no_save_optim: Optional[bool] = switch(
        "Do not save the optimizer state.",
        default=None,
        honoured_at="checkpointing.save_checkpoint; checkpointing_dist.save_checkpoint_dist",
    )
    no_save_rng: Optional[bool] = switch(
        "Do not save the RNG state.",
        default=None,
        honoured_at="checkpointing.save_checkpoint; checkpointing_dist.save_checkpoint_dist",
    )
    load: Optional[str] = flag(
        None,
        "Directory holding the checkpoint to load.",
        honoured_at="model_setup.setup_model_and_optimizer; "
        "tools.run_text_generation_server._check_server_args",
    )
    no_load_optim: Optional[bool] = switch(
        "Do not load the optimizer state.",
        default=None,
        honoured_at="checkpointing.load_checkpoint; checkpointing_dist.load_checkpoint_dist; "
        "tools.run_text_generation_server._serve",
    )
    load_main_params_from_ckpt: bool = switch(
        "Load the fp32 main parameters from the checkpoint (needs --no-load-optim)."
    )
    override_ckpt_iteration: Optional[int] = flag(
        None, "Resume counting from this iteration instead of the checkpoint's."
    )
    no_load_rng: Optional[bool] = switch(
        "Do not load the RNG state.",
        default=None,
        honoured_at="checkpointing.load_checkpoint; checkpointing_dist.load_checkpoint_dist; "
        "tools.run_text_generation_server._serve",
    )
    non_persistent_save_interval: Optional[int] = flag(
        None, "Iterations between non-persistent saves."
    )
    non_persistent_ckpt_type: Optional[str] = flag(
        None, "Kind of non-persistent checkpoint.", choices=["global", "local", "in_memory"]
    )
    non_persistent_global_ckpt_dir: Optional[str] = flag(
        None, "Directory of global non-persistent checkpoints."
    )
    non_persistent_local_ckpt_dir: Optional[str] = flag(
        None, "Directory of local non-persistent checkpoints."
    )
    non_persistent_local_ckpt_algo: str = flag(
        "fully_parallel", "Local checkpoint algorithm.", choices=["fully_parallel", "atomic"]
    )
    finetune: bool = switch(
        "Load weights only (no optimizer/RNG state) and restart at iteration 0.",
        honoured_at="checkpointing.load_checkpoint; checkpointing_dist.load_checkpoint_dist",
    )
    pretrained_checkpoint: Optional[str] = flag(
        None,
        "Checkpoint to start fine-tuning from.",
        honoured_at="model_setup.setup_model_and_optimizer",
    )
    ckpt_step: Optional[int] = flag(
        None,
        "Load this iteration instead of the latest.",
        honoured_at="checkpointing.load_checkpoint",
    )
    perform_initialization: bool = off_switch(
        "Skip weight initialization (when a checkpoint will be loaded anyway).",
        options="--no-initialization",
        honoured_at="TransformerConfig.perform_initialization",
    )
    use_checkpoint_args: bool = switch(
        "Override model flags with those stored in the checkpoint.",
        honoured_at="arguments.parse_and_validate_args (checkpointing.load_args_from_checkpoint)",
    )
    use_mp_args_from_checkpoint_args: bool = switch(
        "Take the parallel sizes from the checkpoint.",
        honoured_at="checkpointing.load_args_from_checkpoint",
    )
    use_tokenizer_model_from_checkpoint_args: bool = off_switch(
        "Do not take the tokenizer model path from the checkpoint args.",
        honoured_at="this code base never takes the tokenizer model path or tokenizer files "
        "from a checkpoint",
    )
    exit_on_missing_checkpoint: bool = switch(
        "Exit if --load holds no checkpoint instead of starting from random weights.",
        honoured_at="checkpointing.load_checkpoint; tools.run_text_generation_server._serve",
    )
    use_dist_ckpt_deprecated: bool = switch(
        "Deprecated, no effect: see --ckpt-format.",
        options="--use-dist-ckpt",
        honoured_at="rules/deprecated.py: a warning; no effect, as in Megatron",
    )
    use_persistent_ckpt_worker: bool = switch("Use a persistent worker process for async saves.")
    auto_detect_ckpt_format: bool = switch(
        "Detect the format of the checkpoint being loaded.",
        honoured_at="checkpointing.format_to_load",
    )
    dist_ckpt_format_deprecated: Optional[str] = flag(
        None,
        "Deprecated, no effect: see --ckpt-format.",
        options="--dist-ckpt-format",
        type=None,
        honoured_at="rules/deprecated.py: a warning; no effect, as in Megatron",
    )
    ckpt_format: str = flag(
        "torch_dist",
        "Checkpoint format: torch (torch.save files per rank) or a distributed format.",
        choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"],
        honoured_at="checkpointing.save_checkpoint; checkpointing.format_to_load; "
        "checkpointing.convert_checkpoint_and_exit",
    )
    ckpt_convert_format: Optional[str] = flag(
        None,
        "Convert the loaded checkpoint to this format.",
        choices=["torch", "torch_dist"],
        honoured_at="model_setup.setup_model_and_optimizer; checkpointing.format_to_load; "
        "checkpointing.load_checkpoint",
    )
    ckpt_convert_save: Optional[str] = flag(
        None,
        "Directory for the converted checkpoint.",
        honoured_at="checkpointing.convert_checkpoint_and_exit",
    )
    ckpt_convert_update_legacy_dist_opt_format: bool = switch(
        "Update a legacy distributed optimizer checkpoint when loading."
    )
    ckpt_fully_parallel_save_deprecated: bool = switch(
        "Deprecated, no effect: see --no-ckpt-fully-parallel-save.",
        options="--ckpt-fully-parallel-save",
        honoured_at="rules/deprecated.py: a warning; no effect, as in Megatron",
    )
    ckpt_fully_parallel_save: bool = off_switch(
        "Do not spread distributed checkpoint writes over the data-parallel ranks.",
        options="--no-ckpt-fully-parallel-save",
        honoured_at="checkpointing_dist.save_checkpoint_dist",
    )
    async_save: bool = switch(
        "Save checkpoints asynchronously.",
        honoured_at="progress_log.log_checkpoint_saved; "
        "checkpointing.convert_checkpoint_and_exit; "
        "checkpointing_dist.save_checkpoint_dist",
    )
    async_strategy: str = flag(
        "nvrx", "Implementation of asynchronous saves.", choices=["nvrx", "mcore"]
    )
    async_ckpt_cpu_priority: int = flag(10, "CPU scheduling priority of the async writer.")
    async_ckpt_io_priority: int = flag(3, "I/O priority of the async writer.")
    async_ckpt_use_cpu_shm: bool = switch("Stage async checkpoints in CPU shared memory.")
    ckpt_fully_parallel_load: bool = switch(
        "Spread distributed checkpoint reads over the data-parallel ranks."
    )
    ckpt_fully_parallel_load_exchange_algo: str = flag(
        "broadcast",
        "How ranks exchange what they read in a fully parallel load.",
        choices=["broadcast", "gather_rounds", "gather_object"],
    )
    ckpt_fully_parallel_load_per_rank_objects: bool = switch(
        "Each rank reads its own non-tensor objects in a fully parallel load."
    )
    ckpt_fully_parallel_save_process_group: str = flag(
        "dp", "Group over which a fully parallel save is spread.", choices=["dp", "ep_dp"]
    )
    ckpt_fully_parallel_load_process_group: str = flag(
        "dp", "Group over which a fully parallel load is spread.", choices=["dp", "ep_dp"]
    )
    ckpt_pg_tensors_cache_path: Optional[str] = flag(
        None, "Cache of the process-group tensors of a save."
    )
    ckpt_pg_tensors_cache_create: bool = switch("Write that cache.")
    ckpt_load_validate_sharding_integrity: bool = off_switch(
        "Do not check that the loaded shards cover every tensor."
    )
    strict_fsdp_dtensor_load: bool = off_switch("Load fsdp_dtensor checkpoints non-strictly.")
    ckpt_assume_constant_structure: bool = switch(
        "The state dict structure never changes during the job (enables caching)."
    )
    dist_ckpt_strictness: str = flag(
        "assume_ok_unexpected",
        "Key-mismatch handling when loading a distributed checkpoint.",
        choices=[
            "assume_ok_unexpected",
            "log_unexpected",
            "log_all",
            "raise_unexpected",
            "raise_all",
            "return_unexpected",
            "return_all",
            "ignore_all",
        ],
        honoured_at="checkpointing_dist.load_checkpoint_dist",
    )
    dist_ckpt_optim_fully_reshardable: bool = switch(
        "Make the optimizer state reshardable across every parallel dimension.",
        honoured_at="checkpointing_dist._writes_dp_reshardable",
    )
    distrib_optim_fully_reshardable_mem_efficient: bool = switch(
        "Memory-efficient variant of --dist-ckpt-optim-fully-reshardable."
    )
    dist_ckpt_save_pre_mcore_014: bool = switch(
        "Save distributed checkpoints in the layout of Megatron Core before 0.14."
    )
    dist_ckpt_workers: int = flag(1, "Writer processes per rank of a distributed save.")
    ckpt_drop_redundant_extra_state: bool = switch(
        "Do not save the replicated extra state of every rank.",
        honoured_at="the _extra_state objects written here are empty (no fp8 metadata): there "
        "is none to drop",
    )
    save_tokenizer_assets: bool = off_switch(
        "Do not copy the tokenizer files into the checkpoint.",
        honoured_at="this code base never takes the tokenizer model path or tokenizer files "
        "from a checkpoint",
    )
    replication: bool = switch("Replicate each rank's checkpoint on other nodes.")
    replication_jump: Optional[int] = flag(
        None, "Rank distance between a checkpoint and its replica."
    )
    replication_factor: int = flag(2, "Copies kept of each checkpoint.")
    verify_integrity: bool = switch(
        "Write a SHA-256 manifest of the checkpoint's files when saving and check it when "
        "loading; a changed or missing file ends the load.",
        honoured_at="checkpoint_integrity.integrity_digests; checkpointing.load_checkpoint",
    )
