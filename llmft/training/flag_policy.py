"""Every flag `llmft train` accepts, and what llmft does with it: no flag is accepted and silently ignored.

`llmft train` takes TRL's ScriptArguments, SFTConfig and ModelConfig plus llmft's own LlmftArguments; with
`--method dpo|kto|reward` the method's config (DPOConfig, KTOConfig, RewardConfig) takes SFTConfig's place, and that
method's own rows (llmft.planning.methods, Method.flags) go over POLICY (`policy_for`).
POLICY names every one of their fields with what happens to it:

    used     llmft reads it itself (batch math, DeepSpeed config, data, checkpoints, model loading)
    passed   handed unchanged to TRL's SFTTrainer / HF's Trainer, which implement it
    checked  used or passed, but some values are refused with the reason (llmft.training.flags.check_flags)
    refused  llmft cannot honour it: any value other than the default stops the run with the reason
    eval     evaluation flags: HF's evaluation loop runs them on the data llmft.prepare prepared

tests/test_flags.py walks the dataclass fields against this table, so a flag added by a TRL or
transformers upgrade fails the tests until someone decides what llmft does with it.

The table is data, importable without torch or TRL (nothing but the standard library): the job launchers
(llmft.launch.sweep) check a SWEEP's flag names against it on a batch host's python3, before anything trains.
"""

from __future__ import annotations

from llmft.planning.methods import METHODS, method

USED, PASSED, CHECKED, REFUSED, EVAL = "used", "passed", "checked", "refused", "eval"


def _table(kind: str, names: str, why: str) -> dict[str, tuple[str, str]]:
    return {name: (kind, why) for name in names.split()}


POLICY: dict[str, tuple[str, str]] = {
    # ---- ScriptArguments
    **_table(USED, "dataset_name dataset_config dataset_train_split", "llmft.data.loading loads the training split"),
    "dataset_streaming": (
        REFUSED,
        "llmft reads the whole split to check it, fingerprint it and take --data_percentage; "
        "streaming is not supported",
    ),
    "ignore_bias_buffers": (REFUSED, "it tells PyTorch DDP which buffers to skip; DeepSpeed ZeRO has no such setting"),
    # ---- ModelConfig
    **_table(
        USED, "model_name_or_path model_revision", "config, tokenizer and weights load from this model and revision"
    ),
    "dtype": (USED, "passed to the model load (model_init_kwargs)"),
    "attn_implementation": (
        CHECKED,
        "auto (the default): flash-attention 2 where installed and supported, else SDPA "
        "(llmft.planning.hardware.choose_attention, logged); a choice that cannot run here is refused",
    ),
    "use_peft": (USED, "LoRA adapters through PEFT (trl.get_peft_config)"),
    **_table(
        CHECKED,
        "lora_r lora_alpha lora_dropout lora_target_modules lora_target_parameters lora_modules_to_save "
        "lora_task_type use_rslora use_dora",
        "PEFT LoraConfig settings; refused without --use_peft",
    ),
    **_table(
        CHECKED,
        "load_in_4bit load_in_8bit bnb_4bit_quant_type use_bnb_nested_quant bnb_4bit_quant_storage",
        "QLoRA through bitsandbytes; llmft.planning.qlora.choose_quantization decides",
    ),
    # ---- SFTConfig / TrainingArguments: what llmft reads or computes
    "output_dir": (
        CHECKED,
        "checkpoints, the resolved DeepSpeed config and the run record live here; a file is refused",
    ),
    **_table(
        USED,
        "per_device_train_batch_size gradient_accumulation_steps",
        "llmft.planning.batch derives the accumulation",
    ),
    **_table(
        USED,
        "weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm",
        "written into the resolved DeepSpeed config (optimizer block, gradient_clipping)",
    ),
    "learning_rate": (CHECKED, "written into the DeepSpeed optimizer block; a negative rate is refused"),
    **_table(
        CHECKED,
        "optim optim_args",
        "llmft.planning.ds_config.choose_optimizer maps it onto DeepSpeed's optimizer, "
        "lets the Trainer's optimizer run, or refuses it",
    ),
    "optim_target_modules": (
        REFUSED,
        "it configures GaLore/APOLLO optimizers, which llmft does not run under DeepSpeed",
    ),
    **_table(USED, "bf16 fp16", "mapped onto llmft's precision decision (llmft.planning.hardware.choose_precision)"),
    "deepspeed": (USED, "the DeepSpeed template llmft resolves (instead of --zero_stage)"),
    "resume_from_checkpoint": (
        USED,
        "llmft.checkpoint.run_dir.resolve_resume; an explicit path also continues a run on purpose",
    ),
    **_table(USED, "model_init_kwargs trust_remote_code", "merged into the model load"),
    **_table(USED, "dataset_text_field", "the text column (llmft.data.formats.shape_for_sft)"),
    "max_length": (CHECKED, "capped at the model's positions (logged); must be positive"),
    "seed": (USED, "also picks the --data_percentage subset"),
    "num_train_epochs": (CHECKED, "must be positive unless --max_steps is"),
    "save_total_limit": (
        USED,
        "applied by llmft after each checkpoint is published complete, counting complete "
        "checkpoints only (llmft.checkpoint.run_dir.rotate); the Trainer gets None",
    ),
    "use_cpu": (
        CHECKED,
        "llmft trains on the GPUs when CUDA is visible and on CPU otherwise; a contradiction is refused",
    ),
    "dataloader_pin_memory": (USED, "kept on GPUs, off without CUDA (nothing to pin for)"),
    "include_num_input_tokens_seen": (
        PASSED,
        "the Trainer's own num_input_tokens_seen log; llmft's tokens/s counts "
        "tokens itself (llmft.training.metrics), without the Trainer's per-micro-batch gather",
    ),
    # ---- refused: settings that have no effect under DeepSpeed ZeRO, or undo llmft's guarantees
    "auto_find_batch_size": (
        REFUSED,
        "it changes the micro-batch after DeepSpeed's config is fixed; "
        "choose --per_device_train_batch_size (llmft keeps the global batch)",
    ),
    "save_only_model": (
        REFUSED,
        "checkpoints without optimizer state and ZeRO shards cannot be resumed or read by llmft infer",
    ),
    "save_on_each_node": (
        REFUSED,
        "llmft's checkpoints live on storage every node shares; "
        "saving on each node would have every node write the same files",
    ),
    "enable_jit_checkpoint": (
        REFUSED,
        "llmft already checkpoints on SIGTERM/SIGUSR1 (--stop_file); "
        "a second checkpoint on the same signal would race it",
    ),
    **_table(
        REFUSED,
        "ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph",
        "a PyTorch DDP setting; DeepSpeed ZeRO replaces DDP",
    ),
    **_table(
        REFUSED,
        "fsdp fsdp_config parallelism_config",
        "llmft parallelises with DeepSpeed ZeRO (--zero_stage) and --sequence_parallel",
    ),
    "do_predict": (REFUSED, "llmft train does not predict; use llmft infer"),
    # ---- passed to TRL / HF unchanged
    **_table(
        PASSED,
        "max_steps lr_scheduler_type lr_scheduler_kwargs warmup_steps average_tokens_across_devices "
        "label_smoothing_factor tf32 activation_checkpointing_kwargs "
        "gradient_checkpointing_kwargs torch_compile_backend "
        "torch_compile_mode use_cache neftune_noise_alpha "
        "torch_empty_cache_steps",
        "the Trainer's training loop and model set-up",
    ),
    "logging_nan_inf_filter": (
        USED,
        "llmft's trainer applies it on the device (llmft.sync_free): the same logged loss, "
        "without a host sync per micro-batch",
    ),
    **_table(
        PASSED,
        "logging_strategy logging_steps logging_first_step log_on_each_node "
        "log_level log_level_replica disable_tqdm report_to run_name project trackio_space_id "
        "trackio_bucket_id trackio_static_space_id skip_memory_metrics debug",
        "the Trainer's logging",
    ),
    **_table(
        PASSED,
        "save_strategy save_steps push_to_hub hub_token hub_private_repo hub_model_id hub_strategy "
        "hub_always_push hub_revision ignore_data_skip restore_callback_states_from_checkpoint",
        "the Trainer's saving, pushing and resuming",
    ),
    **_table(
        PASSED,
        "full_determinism data_seed accelerator_config ddp_backend ddp_timeout local_rank",
        "the Trainer's and accelerate's set-up (local_rank is set by launchers)",
    ),
    **_table(
        PASSED,
        "dataloader_drop_last dataloader_num_workers dataloader_persistent_workers dataloader_prefetch_factor "
        "dataloader_multiprocessing_context dataloader_in_order remove_unused_columns label_names "
        "train_sampling_strategy length_column_name",
        "the Trainer's data loader",
    ),
    **_table(
        CHECKED,
        "use_liger_kernel liger_kernel_config",
        "Liger's kernels: on by default where they run in bf16 (llmft.planning.hardware.choose_liger); asked for, "
        "refused without a CUDA GPU, liger-kernel or a model type it supports",
    ),
    "do_train": (PASSED, "a flag for HF's example scripts; llmft train always trains"),
    **_table(
        PASSED,
        "router_aux_loss_coef chat_template_path dataset_num_proc eos_token pad_token "
        "truncation_mode shuffle_dataset pad_to_multiple_of "
        "completion_only_loss loss_type",
        "TRL's data preparation (run once by llmft.prepare, part of its cache key), packing and loss",
    ),
    "activation_offloading": (
        CHECKED,
        "TRL's offload of activations to host RAM (with gradient checkpointing: ALST's checkpoint offload); refused "
        "without a CUDA GPU, where activations are in host memory already; --auto turns it on when the planner says so",
    ),
    **_table(
        USED,
        "dataset_kwargs assistant_only_loss",
        "applied once by llmft.prepare (the assistant mask is in the "
        "prepared labels); the Trainer gets the prepared data",
    ),
    **_table(
        CHECKED,
        "packing packing_strategy padding_free",
        "packed samples must not attend to each other: "
        "llmft.training.packing.check_packing refuses what would let them",
    ),
    # ---- evaluation: llmft.prepare prepares the eval data; HF's Trainer evaluates on it
    "dataset_test_split": (USED, "the split of --eval_dataset_name that llmft.prepare loads"),
    **_table(
        EVAL,
        "eval_strategy eval_steps eval_delay per_device_eval_batch_size prediction_loss_only "
        "eval_on_start eval_do_concat_batches eval_use_gather_object eval_accumulation_steps include_for_metrics "
        "batch_eval_metrics bf16_full_eval fp16_full_eval load_best_model_at_end metric_for_best_model "
        "greater_is_better do_eval eval_packing",
        "HF's evaluation loop on the prepared eval data; an eval strategy without eval data is refused (llmft.prepare)",
    ),
    # ---- LlmftArguments
    **_table(
        USED,
        "zero_stage offload global_batch_size data_percentage precision prompt_column completion_column "
        "messages_column stop_file eval_dataset_name eval_split_ratio prepare_timeout dataset_mixture",
        "llmft's own flags",
    ),
    **_table(
        USED,
        "dataset_format prompt_template role_map drop_long_records",
        "llmft.data's formats, prompt templates and over-long records: applied once by llmft.prepare (part of its cache key)",
    ),
    "method": (
        USED,
        "the training method (llmft.planning.methods): its TRL config and trainer; another method's flags are refused",
    ),
    "auto": (
        CHECKED,
        "llmft.plan.auto_choice picks ZeRO stage, offload, micro-batch and gradient checkpointing; "
        "refused with --zero_stage/--offload/--deepspeed",
    ),
    "save_consolidated": (
        CHECKED,
        "ZeRO-3: the gathered 16-bit model at the end (llmft.training.checkpoint_save); refused on other stages and with LoRA",
    ),
    "async_save": (
        CHECKED,
        "periodic checkpoints written in the background (llmft.training.checkpoint_async_save); refused with a "
        "DeepSpeed config that chose its own checkpoint writer",
    ),
    **_table(
        USED,
        "gradient_checkpointing activation_checkpointing torch_compile",
        "passed to the Trainer as given; not given, llmft decides them by the GPU measurements "
        "(llmft.planning.speed_defaults): recomputation off where the planner says the run fits without it, "
        "torch.compile on where it was measured and the run is planned long enough to repay its compile",
    ),
    "profile_step": (
        CHECKED,
        "torch.profiler over that optimizer step (llmft.training.profile_step); refused below 1 or past --max_steps",
    ),
    "tiled_mlp": (
        USED,
        "DeepSpeed's TiledMLP on every gated MLP (llmft.training.tiled_mlp); refused for a model without one",
    ),
    "sequence_parallel": (
        CHECKED,
        "DeepSpeed's Ulysses through accelerate's ParallelismConfig (llmft.planning.sequence_parallel): the batch over "
        "world / N data-parallel ranks; refused where the world, the model's heads, the attention or packing cannot "
        "take it, and on a resume with another N; --auto plans with it",
    ),
}


def policy_for(name: str | None) -> dict[str, tuple[str, str]]:
    """The policy of `llmft train --method NAME`: POLICY (TrainingArguments, SFT's own fields, llmft's) with the
    method's own rows (llmft.planning.methods: a DPO --loss_type is DPO's) over it."""
    return {**POLICY, **method(name).flag_policy}


def all_flag_names() -> set[str]:
    """Every flag name some method's `llmft train` accepts (the launchers check a SWEEP's flags against it)."""
    return set(POLICY).union(*(m.flag_policy for m in METHODS.values()))
