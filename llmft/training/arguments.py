"""The flags llmft adds to TRL's ScriptArguments, SFTConfig and ModelConfig (llmft.training.flags says what each does)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LlmftArguments:
    """What llmft adds to TRL's flags."""

    method: str = field(
        default="sft",
        metadata={
            "help": "sft, dpo, kto or reward (llmft.planning.methods): the TRL trainer and config this run uses; "
            "the flags of another method's config are refused."
        },
    )
    zero_stage: int | None = field(
        default=None, metadata={"help": "ZeRO stage 0-3, using ds_configs/zeroN.json (default 2)."}
    )
    offload: bool = field(default=False, metadata={"help": "Offload optimizer state (and ZeRO-3 parameters) to CPU."})
    global_batch_size: int | None = field(
        default=None,
        metadata={"help": "Samples per optimizer step over all processes; accumulation is derived from it."},
    )
    data_percentage: float = field(
        default=100.0, metadata={"help": "Train on this percentage (0-100] of the training split."}
    )
    precision: str = field(
        default="auto",
        metadata={"help": "auto (bf16 on Ampere+, fp16 on older GPUs, fp32 on CPU), bf16, fp16 or fp32."},
    )
    prompt_column: str | None = field(
        default=None, metadata={"help": "Dataset field holding the prompt (e.g. question)."}
    )
    completion_column: str | None = field(
        default=None, metadata={"help": "Dataset field holding the completion (e.g. answer)."}
    )
    messages_column: str | None = field(
        default=None, metadata={"help": "Dataset field holding chat messages (role/content or ShareGPT from/value)."}
    )
    dataset_format: str = field(
        default="auto",
        metadata={
            "help": "auto (recognised from the fields), text, prompt_completion, messages, alpaca "
            "(instruction/input/output) or sharegpt (conversations of from/value); see llmft.data.formats."
        },
    )
    prompt_template: str | None = field(
        default=None,
        metadata={
            "help": "Build the prompt from the record's fields: a preset (alpaca; gsm8k = lm-evaluation-harness "
            "gsm8k's 'Question: ...\\nAnswer:') or a format string such as 'Q: {question}\\nA: '."
        },
    )
    role_map: str | None = field(
        default=None,
        metadata={"help": "Chat speaker names -> roles, e.g. bot=assistant,person=user (ShareGPT and messages data)."},
    )
    drop_long_records: bool = field(
        default=False,
        metadata={
            "help": "Drop records longer than --max_length instead of truncating them (counted in the data-fit line)."
        },
    )
    stop_file: str | None = field(
        default=None,
        metadata={"help": "When this file appears, save a complete checkpoint and stop (default: $LLMFT_STOP_FILE)."},
    )
    auto: bool = field(
        default=False,
        metadata={
            "help": "Let llmft's memory planner pick the ZeRO stage, CPU offload, micro-batch (up to "
            "--per_device_train_batch_size) and gradient checkpointing (never on with "
            "--gradient_checkpointing false) for this job's GPUs and RAM; see `llmft plan --model`."
        },
    )
    save_consolidated: bool = field(
        default=False,
        metadata={
            "help": "ZeRO-3: gather the 16-bit model on rank 0 into --output_dir at the end (needs about twice "
            "its 16-bit size in host RAM there; `llmft plan --save_consolidated` counts it)."
        },
    )
    async_save: bool = field(
        default=False,
        metadata={
            "help": "Write periodic checkpoints in the background while training goes on (llmft.training.checkpoint_async_save); "
            "the stop save and the last save stay synchronous. Holds a checkpoint's files in host RAM "
            "while they are written (`llmft plan --async_save` counts it)."
        },
    )
    sequence_parallel: int = field(
        default=1,
        metadata={
            "help": "Ulysses sequence parallelism (DeepSpeed's, through accelerate): each sample's sequence is split "
            "over groups of N ranks, data-parallel size = world / N, the global batch counted over data-parallel "
            "ranks (llmft.planning.sequence_parallel)."
        },
    )
    tiled_mlp: bool = field(
        default=False,
        metadata={
            "help": "Run every gated MLP through DeepSpeed's TiledMLP (ALST): only its input is kept for the backward, "
            "which recomputes it in shards; for sequences that do not fit otherwise (llmft.training.tiled_mlp). "
            "--auto turns it on when the planner says so."
        },
    )
    profile_step: int | None = field(
        default=None,
        metadata={
            "help": "Profile optimizer step N with torch.profiler: the 10 kernels (CPU: operators) that took the most "
            "time, written to OUTPUT_DIR/profile_step_N.txt and printed; the rates in run_summary.json leave that "
            "step and those before it out (llmft.training.profile_step)."
        },
    )
    # --bf16/--fp16 as the user gave them (None: not given), recorded by llmft.training.flags.TrainParser; not flags themselves.
    bf16_flag: bool | None = field(default=None, init=False, repr=False)
    fp16_flag: bool | None = field(default=None, init=False, repr=False)
    ddp_timeout_given: bool = field(default=False, init=False, repr=False)  # else llmft sizes it
    eval_dataset_name: str | None = field(
        default=None,
        metadata={"help": "Evaluation data: a file/directory, or a hub dataset (its --dataset_test_split)."},
    )
    eval_split_ratio: float | None = field(
        default=None,
        metadata={"help": "Hold out this fraction (0-1) of the training split for evaluation (deterministic)."},
    )
    prepare_timeout: float = field(
        default=7200.0, metadata={"help": "Seconds the other ranks wait for rank 0 to prepare (tokenise) the data."}
    )
    dataset_mixture: str | None = field(
        default=None,
        metadata={
            "help": "A YAML listing several datasets (path, columns, split, percentage, weight or all) "
            "to train on as one weighted mixture, instead of --dataset_name; see llmft.data.mixture."
        },
    )
