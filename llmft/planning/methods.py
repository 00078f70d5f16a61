"""The training methods `llmft train --method` runs, one entry each: everything that differs between SFT, DPO, KTO
and reward modelling lives in METHODS, and every command reads it from here.

`train`, `prepare`, `plan`, the job scripts (METHOD=) and `report` look a method up with `method(name)` and act on the
entry's fields; no code outside this module asks which method it is running (`tests/test_methods.py` holds this:
no `method ==` anywhere else). A fifth method is one new entry.

The table is data, importable without torch or TRL (standard library only): the job launchers check METHOD= and a
SWEEP's flags against it on a batch host's python3, and the planner counts a method's sequences without importing
TRL. Classes are named as "module:attribute" strings and imported by the layer that runs them.

Why these numbers (TRL 1.16, trl/trainer/*_trainer.py):
- DPO and reward models concatenate chosen and rejected into one forward, so a pair is two sequences through the
  policy; DPO's reference sees both again (forward only, no activations kept).
- KTO runs each example and, unless its loss is "apo_zero_unpaired", a mismatched KL completion through the policy
  and the reference: two sequences an example, each direction.
- A reward model ends in a one-output score head (AutoModelForSequenceClassification, num_labels=1), not the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmft.errors import LlmftError


class MethodError(LlmftError):
    """An unknown method, or data or a flag that belongs to another method."""


@dataclass(frozen=True)
class Method:
    """One training method: its TRL classes, its data, what the planner counts, the mixins, the report's plots."""

    name: str
    description: str
    config_class: str  # "trl:SFTConfig": the dataclass llmft's parser reads this method's flags into
    trainer_class: str  # "trl:SFTTrainer"
    # record formats (llmft.data.formats) this method trains on; the first is what --dataset_format auto expects
    formats: tuple[str, ...]
    batch_unit: str  # what --global_batch_size counts: "examples" or "pairs"
    prepared_by: str  # "llmft": the shared cache tokenises with the trainer's own preparation; "trl": the trainer does
    sequences_per_example: int  # sequences one example puts through the policy's forward and backward
    reference: bool  # a frozen reference model scores the same sequences (forward only)
    loss_head: str  # "lm": the LM head over the vocabulary; "score": a one-output classification head
    mixins: tuple[str, ...]  # llmft trainer mixins (llmft.training) that apply to this method's trainer
    report_metrics: tuple[str, ...]  # the logged metrics `llmft report` plots, beside the loss
    packing: str  # "packing": TRL packs rows; "padding_free": rows concatenated without padding; "": neither
    # flags of this method's config that the shared TrainingArguments/llmft policy does not cover:
    # name -> (kind, why), kinds as in llmft.training.flag_policy
    flags: tuple[tuple[str, tuple[str, str]], ...] = ()
    # the logged metric `llmft train` reports for held-out data (run_summary.json's "eval_<name>"); "" for none
    held_out_metric: str = ""
    # the task of the model TRL builds from the base: "causal_lm" (AutoModelForCausalLM) or "sequence_classification"
    # (AutoModelForSequenceClassification, num_labels=1: the base must have a class for it)
    model_task: str = "causal_lm"
    # the training loss is the mean token negative log-likelihood, so exp(eval loss) is a perplexity (SFT's; DPO's
    # loss is a preference loss, and a perplexity of it means nothing)
    loss_is_nll: bool = False

    @property
    def flag_policy(self) -> dict[str, tuple[str, str]]:
        return dict(self.flags)


# llmft flags that need a mixin a method may lack: flag -> mixin (see Method.mixins); a flag whose mixin the
# method lacks is refused in one line (llmft.training.flags.check_method_flags)
MIXIN_FLAGS: dict[str, str] = {"sequence_parallel": "ulysses"}

# Policy rows (kind, why) for the preference methods' own config fields; kinds as in llmft.training.flag_policy.
_PASSED, _REFUSED = "passed", "refused"
_TRL = "handed to TRL's trainer, which implements it"
_REFERENCE = (
    "the reference model: TRL's default (a copy of the base for full fine-tuning, the adapter disabled for LoRA)"
)
_SYNC_REF = (
    _REFUSED,
    "it mixes the policy into the reference during training, which llmft's checkpoints do not save (a resumed run "
    "would restart from a different reference); drop it",
)
_PADDING_FREE_OFF = (
    _REFUSED,
    "TRL 1.16's DPOTrainer turns padding_free off with a warning and pads anyway (trl/trainer/dpo_trainer.py); "
    "drop --padding_free",
)
# the rows every method with a reference model has (DPO and KTO): its precompute and TRL's reference sync
_REFERENCE_FLAGS = (
    ("beta", (_PASSED, _TRL)),
    ("disable_dropout", (_PASSED, _TRL)),
    ("precompute_ref_log_probs", (_PASSED, _REFERENCE + "; precomputed once before training")),
    ("precompute_ref_batch_size", (_PASSED, _REFERENCE)),
    ("sync_ref_model", _SYNC_REF),
    ("ref_model_mixup_alpha", (_PASSED, "read only with --sync_ref_model, which llmft refuses")),
    ("ref_model_sync_steps", (_PASSED, "read only with --sync_ref_model, which llmft refuses")),
)
_DPO_FLAGS = _REFERENCE_FLAGS + (
    ("loss_type", (_PASSED, "DPO's loss (sigmoid, ipo, hinge, robust, ...): " + _TRL)),
    ("loss_weights", (_PASSED, _TRL)),
    ("ld_alpha", (_PASSED, _TRL)),
    ("f_divergence_type", (_PASSED, _TRL)),
    ("f_alpha_divergence_coef", (_PASSED, _TRL)),
    ("label_smoothing", (_PASSED, _TRL)),
    ("use_weighting", (_PASSED, _TRL)),
    ("discopop_tau", (_PASSED, _TRL)),
    ("truncation_mode", (_PASSED, "TRL tokenises and truncates the pairs itself")),
    ("padding_free", _PADDING_FREE_OFF),
)
_KTO_FLAGS = _REFERENCE_FLAGS + (
    ("loss_type", (_PASSED, "KTO's loss (kto, apo_zero_unpaired): " + _TRL)),
    ("desirable_weight", (_PASSED, _TRL)),
    ("undesirable_weight", (_PASSED, _TRL)),
)
_REWARD_FLAGS = (
    ("center_rewards_coefficient", (_PASSED, _TRL)),
    ("disable_dropout", (_PASSED, _TRL)),
)


_PREFERENCE_PLOTS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")

METHODS: dict[str, Method] = {
    "sft": Method(
        name="sft",
        description="supervised fine-tuning on text, prompt/completion or conversations",
        config_class="trl:SFTConfig",
        trainer_class="trl:SFTTrainer",
        formats=("text", "prompt_completion", "messages", "alpaca", "sharegpt"),
        batch_unit="examples",
        prepared_by="llmft",
        sequences_per_example=1,
        reference=False,
        loss_head="lm",
        mixins=("sync_free", "checkpoint_save", "ulysses"),
        report_metrics=("mean_token_accuracy",),
        packing="packing",
        loss_is_nll=True,
    ),
    "dpo": Method(
        name="dpo",
        description="direct preference optimisation on chosen/rejected pairs against a frozen reference",
        config_class="trl:DPOConfig",
        trainer_class="trl:DPOTrainer",
        formats=("preference",),
        batch_unit="pairs",
        prepared_by="trl",
        sequences_per_example=2,
        reference=True,
        loss_head="lm",
        mixins=("checkpoint_save",),
        report_metrics=_PREFERENCE_PLOTS,
        # TRL 1.16's DPOConfig has padding_free, but DPOTrainer turns it off and pads (dpo_trainer.py): refused
        packing="",
        flags=_DPO_FLAGS,
    ),
    "kto": Method(
        name="kto",
        description="Kahneman-Tversky optimisation on unpaired completions labelled desirable or not",
        config_class="trl:KTOConfig",
        trainer_class="trl:KTOTrainer",
        formats=("unpaired_preference",),
        batch_unit="examples",
        prepared_by="trl",
        sequences_per_example=2,
        reference=True,
        loss_head="lm",
        mixins=("checkpoint_save",),
        report_metrics=("rewards/chosen", "rewards/rejected", "rewards/margins", "kl"),
        packing="",
        flags=_KTO_FLAGS,
    ),
    "reward": Method(
        name="reward",
        description="a reward model: a one-output score head trained to rank chosen above rejected",
        config_class="trl:RewardConfig",
        trainer_class="trl:RewardTrainer",
        formats=("preference",),
        batch_unit="pairs",
        prepared_by="trl",
        sequences_per_example=2,
        reference=False,
        loss_head="score",
        mixins=("checkpoint_save",),
        report_metrics=("accuracy", "margin"),
        packing="",
        flags=_REWARD_FLAGS,
        held_out_metric="accuracy",
        model_task="sequence_classification",
    ),
}

DEFAULT = "sft"


def is_default(name: str | None) -> bool:
    """The default method (sft), which every command runs as it did before --method: its run directories, arguments
    and reports keep their names, so callers ask here rather than compare names themselves."""
    return name in (None, "", DEFAULT)


def method(name: str | None) -> Method:
    """The entry for --method / METHOD=; None means the default (sft). An unknown name is one line naming the choices."""
    key = DEFAULT if name in (None, "") else name
    if key not in METHODS:
        raise MethodError(f"--method {name!r} is not a training method; choose one of {', '.join(METHODS)}")
    return METHODS[key]


def run_key_name(name: str | None) -> str:
    """What a method adds to a job's run directory name and key (llmft.launch.job.run_key): nothing for the default,
    so an SFT run keeps the directory it had before --method existed; "dpo" for DPO."""
    entry = method(name)
    return "" if entry.name == DEFAULT else entry.name
